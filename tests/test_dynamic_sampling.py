"""--dynamic_sampling (DAPO) in grpo.py and rloo.py: the selection against a brute-force filter, and runs whose trained
batches are what a brute-force walk over the same prompt draws keeps, on one and two processes, and exact under a
kill -9 and --resume."""

import json
import random
import sys
import types

import pytest
import torch
from conftest import REPO, kill_after_rows
from test_rloo import check_ok, read_metrics

sys.path.insert(0, REPO)
import infra  # noqa: E402
import utils  # noqa: E402

# for prompts of four of the eight verbs, scores that differ but that the runs' --score_clip 1 makes all 1 (their
# groups carry no advantage), for the others a score in [0, 1) that differs between any two different completions;
# each call appends how many completions it scored to a file beside this one
REWARD = """
import zlib

def flat_or_not(prompts, completions):
    with open(__file__ + ".calls", "a") as f:
        f.write(f"{len(completions)}\\n")
    flat = ("Tell me about", "Describe", "Explain", "Write a poem about")
    crc = [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions]
    return [2.0 + x if p.startswith(flat) else x for p, x in zip(prompts, crc)]
"""
FLAT = ("Tell me about", "Describe", "Explain", "Write a poem about")


def test_selection_matches_a_brute_force_filter():
    rng = random.Random(0)
    for _ in range(500):
        keep, n = [rng.random() < 0.4 for _ in range(rng.randint(1, 12))], rng.randint(1, 6)
        chosen, filled = infra.data.select_groups(keep, n)
        expected = []  # walk the groups in order, taking the kept ones; then the dropped ones, in order
        for i, x in enumerate(keep):
            if x and len(expected) < n:
                expected.append(i)
        for i, x in enumerate(keep):
            if not x and len(expected) < n:
                expected.append(i)
        assert chosen == sorted(expected) and filled == len(expected) - min(n, sum(keep))


def test_distinct_groups_against_a_loop():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (40,), generator=gen).float()  # few values: many groups tie
    scored = torch.rand(40, generator=gen) > 0.2
    got = utils.distinct_groups(scores, scored, 4)
    for j in range(10):
        values = [scores[j * 4 + i].item() for i in range(4) if scored[j * 4 + i]]
        assert got[j].item() == (len(values) >= 2 and len(set(values)) > 1)


def brute_force(texts, seed, updates, local_prompts, world_size, k, rounds):
    """Each update's trained prompts, per process, from a walk over the prompt draws every run makes (infra.data.draw_prompts:
    the global batch, each process taking its slice): each process keeps its prompts whose reward is not flat, in
    order, drawing further global batches while any process has too few (at most `rounds` draws), then fills up with
    its flat ones, in order."""
    data = infra.data.Shuffled(len(texts), seed)
    args = types.SimpleNamespace(local_prompts=local_prompts * world_size, world_size=1, response_length=8,
                                 response_length_min=None, use_vllm=False)  # fmt: skip
    out = []
    for _ in range(updates):
        drawn = [[] for _ in range(world_size)]
        for _ in range(rounds):
            idx = infra.data.draw_prompts(data, args, k, 0)[0]  # the global batch
            for p in range(world_size):
                drawn[p] += [texts[i] for i in idx[p * local_prompts : (p + 1) * local_prompts]]
            if all(sum(not t.startswith(FLAT) for t in d) >= local_prompts for d in drawn):
                break
        batch = []
        for d in drawn:
            kept = [i for i, t in enumerate(d) if not t.startswith(FLAT)][:local_prompts]
            flat = [i for i, t in enumerate(d) if t.startswith(FLAT)][: local_prompts - len(kept)]
            batch.append([d[i] for i in sorted(kept + flat)])
        out.append(batch)
    return out


def trained_prompts(out, local_prompts, world_size, k):
    rows = [json.loads(line) for line in open(out / "completions.jsonl")]
    updates = sorted({r["update"] for r in rows})
    per_update = []
    for u in updates:
        texts = [r["prompt"] for r in rows if r["update"] == u][::k]  # one row per group
        per_update.append([texts[p * local_prompts : (p + 1) * local_prompts] for p in range(world_size)])
    return per_update, rows


def command(script, model, train, reward, out, extra=""):
    k = {"rloo.py": "--rloo_k 4", "grpo.py": "--num_generations 4"}[script]
    return (
        f"{script} {k} --model_name_or_path {model} --dataset_name {train} --output_dir {out}"
        f" --reward_fn {reward}:flat_or_not --score_clip 1 --dynamic_sampling --max_sampling_rounds 2 --log_completions"
        " --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --response_length 8 --temperature 1.0"
        f" --learning_rate 1e-3 --num_sample_generations 0 --no_save_model {extra}"
    )


@pytest.mark.parametrize("script", ["grpo.py", "rloo.py"])
def test_trained_batches_are_the_brute_force_selection(script, run, tmp_path, tiny_model_dir, tiny_prompts_file):
    (tmp_path / "reward.py").write_text(REWARD)
    out = tmp_path / "out"
    check_ok(run(command(script, tiny_model_dir, tiny_prompts_file, tmp_path / "reward.py", out, "--total_episodes 96"),
                 cwd=tmp_path))  # fmt: skip
    texts = [json.loads(line)["prompt"] for line in open(tiny_prompts_file)]
    got, rows = trained_prompts(out, local_prompts=4, world_size=1, k=4)
    assert got == brute_force(texts, seed=1, updates=6, local_prompts=4, world_size=1, k=4, rounds=2)
    metrics = read_metrics(out)
    # every completion is scored once, as it is generated: the kept ones are not scored again
    calls = [int(n) for n in (tmp_path / "reward.py.calls").read_text().split()]
    assert sum(calls) == 4 * sum(m["dynamic_sampling/generated"] for m in metrics)
    for m, batch in zip(metrics, got):
        flat = sum(t.startswith(FLAT) for t in batch[0])
        assert m["dynamic_sampling/filled"] == flat  # a flat group is only there to fill
        assert m["dynamic_sampling/generated"] == 4 * m["dynamic_sampling/rounds"]
        assert m["dynamic_sampling/dropped"] >= flat
    assert any(m["dynamic_sampling/rounds"] > 1 for m in metrics) and any(m["dynamic_sampling/filled"] for m in metrics)
    # GRPO: the flat groups (fill) have no advantage (RLOO's reward also holds the KL penalty, which differs)
    for row in rows:
        if script == "grpo.py" and row["prompt"].startswith(FLAT):
            assert row["advantage"] == 0.0


def test_two_processes_keep_as_many_groups_and_resume_exactly(tmp_path, tiny_model_dir, tiny_prompts_file):
    """Two processes: each keeps its own first groups with distinct scores, every process as many (the rounds go on
    while either is short), as the brute-force walk says; kill -9 then --resume gives the uninterrupted run's metrics
    and batches (the extra rounds' draws are in the checkpointed generator)."""
    from test_distributed import launch
    from test_reliability import without_eps

    (tmp_path / "reward.py").write_text(REWARD)
    base = command("grpo.py", tiny_model_dir, tiny_prompts_file, tmp_path / "reward.py", "{out}")
    args = base.split(" ", 1)[1] + " --total_episodes 192 --checkpoint_every 1"
    check_ok(launch(2, "grpo.py", args.format(out=tmp_path / "full"), tmp_path))
    expected = read_metrics(tmp_path / "full")
    assert len(expected) == 6
    texts = [json.loads(line)["prompt"] for line in open(tiny_prompts_file)]
    got = trained_prompts(tmp_path / "full", local_prompts=4, world_size=2, k=4)[0]
    assert got == brute_force(texts, seed=1, updates=6, local_prompts=4, world_size=2, k=4, rounds=2)

    cut = tmp_path / "cut"
    proc = launch(2, "grpo.py", args.format(out=cut), tmp_path, wait=False)
    assert 3 <= kill_after_rows(proc, cut, 3, group=True) < 6
    check_ok(launch(2, "grpo.py", args.format(out=cut) + " --resume", tmp_path))
    assert without_eps(read_metrics(cut)) == without_eps(expected)
    assert trained_prompts(cut, local_prompts=4, world_size=2, k=4)[0] == got
