"""--max_staleness: batches sampled ahead, in a thread, on a copy of the policy with the weights of when they were drawn
(infra/ahead.py), and the loss's importance weights that correct for it."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, kill_after_rows
from safetensors.torch import load_file
from test_distributed import assert_same_run, launch, runs  # noqa: F401 (runs: the fixture)
from test_reliability import without_eps
from test_rloo import VOWELS, check_ok, read_metrics
from test_vllm import EAGER, needs_vllm

# runs a script as a user would, recording each update's prompts and noise (Sampler.draw), each Batch as sampled and
# scored, and rloo.py's importance weights of each update, into RECORD
PROBE = """
import atexit, os, runpy, sys
import torch
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
import infra, utils
record = {"draws": [], "batches": [], "weights": []}
draw = infra.rollout.Sampler.draw
def recorded_draw(self, index=None):
    prompts = draw(self, index)
    record["draws"].append(prompts)
    return prompts
infra.rollout.Sampler.draw = recorded_draw
infra.hooks.WATCH["batch"].append(lambda sampler, batch: record["batches"].append(batch))
weights = utils.importance_weights
def recorded_weights(logprobs, behaviour_logprobs, sampled, **kw):
    out = weights(logprobs, behaviour_logprobs, sampled, **kw)
    record["weights"].append((logprobs.clone(), out[0].clone(), kw))
    return out
utils.importance_weights = recorded_weights
atexit.register(lambda: torch.save(record, os.environ["RECORD"]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def probe_run(script, args, tmp_path):
    """script run with args through PROBE; its record (draws, batches, importance weights)"""
    (tmp_path / "probe.py").write_text(PROBE)
    record = tmp_path / "record.pt"
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "probe.py"), os.path.join(REPO, script), *args.split()],
        capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "RECORD": str(record)}, timeout=600,
    )  # fmt: skip
    check_ok(proc)
    return torch.load(record, weights_only=False)


def common(model, prompts, out):
    return (
        f"--model_name_or_path {model} --dataset_name {prompts} --output_dir {out} --per_device_train_batch_size 8"
        " --gradient_accumulation_steps 2 --response_length 8 --temperature 1.0 --num_sample_generations 0"
    )


def weights_of(model_dir, version, out):
    """the policy the run had after `version` updates: the initial model, or its checkpoint's weights"""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if version:
        saved = load_file(os.path.join(out, f"checkpoint-{version:07d}", "model.safetensors"))
        assert set(model.load_state_dict(saved, strict=False).missing_keys) <= {"lm_head.weight"}  # (tied: the embeddings)
        model.tie_weights()
    return model


def naive_logprobs(model, batch, temperature):
    """each sampled token's log-probability under model, one row and one token at a time (the real tokens only)"""
    out = torch.zeros(batch.responses.shape)
    for r in range(len(batch.responses)):
        ids = batch.query_responses[r][batch.attention_mask[r].bool()]
        prompt = int(batch.attention_mask[r, : batch.context_length].sum())
        with torch.no_grad():
            logits = model(ids[None]).logits[0].double() / temperature
        for t in range(int(batch.lengths[r])):
            out[r, t] = torch.log_softmax(logits[prompt + t - 1], -1)[ids[prompt + t]]
    return out


@pytest.mark.parametrize("sync, versions", [(1, [0, 0, 0, 1, 2, 3]), (2, [0, 0, 0, 2, 2, 4])])
def test_each_batch_is_sampled_by_the_weights_it_claims_and_weighed_against_them(
    sync, versions, tmp_path, eos_model_dir, tiny_prompts_file
):
    """rloo.py --max_staleness 2, a checkpoint after every update: batch u was drawn at update u - 2 and records
    version max(0, u - 3) (with --weight_sync_steps 2, the sampler given every second update's weights: the oldest
    of those within 2 updates, drawn as they are given); the weights of that version (the initial model or that
    checkpoint), given the update's noise, sample its tokens again exactly, and give the logprobs it recorded (the
    behaviour's). Each update's importance
    weights equal a naive loop's: exp of the sum over the completion's tokens of log p_start - log p_version, truncated
    at 3 (rloo.py's sequence_truncate), where p_start is the policy at the update's start (the checkpoint before it)."""
    from transformers import AutoTokenizer

    from infra.rollout import sample_completions

    tokenizer = AutoTokenizer.from_pretrained(eos_model_dir)

    (tmp_path / "reward.py").write_text(VOWELS)
    out = tmp_path / "out"
    args = common(eos_model_dir, tiny_prompts_file, out)
    args += f" --rloo_k 4 --reward_fn {tmp_path}/reward.py:vowels --total_episodes 96 --learning_rate 3e-3"
    args += f" --max_staleness 2 --weight_sync_steps {sync} --checkpoint_every 1 --keep_checkpoints 10"
    rec = probe_run("rloo.py", args, tmp_path)
    rows = read_metrics(out)
    assert [r["async/staleness"] for r in rows] == [u - 1 - v for u, v in enumerate(versions, start=1)]
    batches = rec["batches"]
    assert [b.version for b in batches] == versions
    assert len(rec["draws"]) == 6 and len(rec["weights"]) == 6
    for u, (batch, prompts, (start, weights, kw)) in enumerate(zip(batches, rec["draws"], rec["weights"]), start=1):
        model = weights_of(eos_model_dir, batch.version, out)
        mask = batch.attention_mask[:, : batch.context_length]
        again, _ = sample_completions(
            model, None, batch.queries, mask, k=4, max_length=8, rule=1.0, stop_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            uniforms=prompts.uniforms, seeds=None, chunk=batch.chunk, group=batch.group,
        )  # fmt: skip
        stop = tokenizer.eos_token_id
        for r in range(len(again)):  # the same tokens up to each completion's end
            n = int(batch.lengths[r])
            assert torch.equal(again[r, :n], batch.responses[r, :n]), (u, r)
            assert stop in again[r, :n] or n == 8
        behaviour = naive_logprobs(model, batch, 1.0)
        real = batch.sampled
        torch.testing.assert_close(batch.behaviour_logprobs[real], behaviour[real], atol=1e-4, rtol=0)
        at_start = naive_logprobs(weights_of(eos_model_dir, u - 1, out), batch, 1.0)
        torch.testing.assert_close(start[real], at_start[real], atol=1e-4, rtol=0)
        expected = torch.stack([(at_start[r] - behaviour[r])[real[r]].sum().exp().clamp(max=3.0) for r in range(len(real))])
        assert kw["mode"] == "sequence_truncate"
        torch.testing.assert_close(weights, expected.float(), atol=1e-4, rtol=1e-4)
        if u - 1 > batch.version:  # stale: the policy moved, and the weights say by how much
            assert (weights - 1).abs().max() > 1e-3, u
        else:
            torch.testing.assert_close(weights, torch.ones_like(weights), atol=1e-4, rtol=0)


def test_without_the_correction_no_weight_and_staleness_zero_untouched(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """--no_vllm_importance_sampling_correction: the stale batches are trained on unweighed (no vllm/ metrics, other
    losses); the same run at --max_staleness 0 has no async/ metric. Each run evaluates on held-out prompts."""
    (tmp_path / "reward.py").write_text(VOWELS)
    base = common(tiny_model_dir, tiny_prompts_file, "{}") + f" --num_generations 4 --reward_fn {tmp_path}/reward.py:vowels"
    base += " --total_episodes 64 --learning_rate 3e-3 --num_iterations 2"
    # a held-out evaluation every 32 episodes: it waits for the sampler ahead (which shares the reward sources)
    base += f" --eval_dataset_name {tiny_prompts_file} --eval_every 32 --eval_batch_size 32"
    metrics = {}
    for name, extra in [
        ("sync", ""),
        ("stale", " --max_staleness 2"),
        ("bare", " --max_staleness 2 --no_vllm_importance_sampling_correction"),
    ]:
        check_ok(run(f"grpo.py {base.format(tmp_path / name)}{extra}", cwd=tmp_path))
        rows = read_metrics(tmp_path / name)
        assert [r["episode"] for r in rows if "eval/scores" in r] == [0, 32, 64]
        metrics[name] = [r for r in rows if "eval/scores" not in r]
    assert not any(k.startswith(("async/", "vllm/")) for k in metrics["sync"][0])
    assert [r["async/staleness"] for r in metrics["stale"]] == [0, 1, 2, 2]
    assert all("vllm/logprob_diff_mean" in r for r in metrics["stale"])
    assert metrics["stale"][-1]["vllm/logprob_diff_mean"] > 1e-4  # two updates old: the policy moved
    assert not any(k.startswith("vllm/") for r in metrics["bare"] for k in r)
    assert metrics["bare"][-1]["loss/policy_avg"] != metrics["stale"][-1]["loss/policy_avg"]
    # the first update's batch is the synchronous run's, sampled by the same weights
    assert metrics["stale"][0]["reward"] == metrics["sync"][0]["reward"] == metrics["bare"][0]["reward"]


JUDGE = """
import json, os, threading, time
import infra.hooks
sampled = []  # the batches the sampler has sampled (before their scores, since they are the scorer's)
infra.hooks.WATCH["batch"].append(lambda sampler, batch: sampled.append(batch))
calls = []

def judge(prompts, completions, **kwargs):
    # each batch but the last waits (at most 20 s) until the sampler has sampled the next one: a sampler that waited
    # for the scores would not sample it while this call runs
    calls.append(None)
    n, deadline = len(calls), time.time() + 20
    while n < int(os.environ["UPDATES"]) and len(sampled) <= n and time.time() < deadline:
        time.sleep(0.01)
    row = {"batch": n, "thread": threading.current_thread().name, "next_sampled": len(sampled) > n}
    with open(os.environ["JUDGED"], "a") as f:
        f.write(json.dumps(row) + "\\n")
    return [float(len(c)) for c in completions]
"""


def test_a_slow_judge_scores_while_the_next_batch_samples(run, tmp_path, monkeypatch, tiny_model_dir, tiny_prompts_file):
    """--max_staleness 1: the scores are the scorer thread's, so the sampler samples the next batch while a judge
    scores one (a judge that waits for that would wait in vain if the sampler scored); the run's scores are the
    judge's."""
    (tmp_path / "judge.py").write_text(JUDGE)
    out, judged = tmp_path / "out", tmp_path / "judged.jsonl"
    args = common(tiny_model_dir, tiny_prompts_file, out) + f" --num_generations 4 --reward_fn {tmp_path}/judge.py:judge"
    monkeypatch.setenv("UPDATES", "4")
    monkeypatch.setenv("JUDGED", str(judged))
    check_ok(run(f"grpo.py {args} --total_episodes 64 --max_staleness 1", cwd=tmp_path))
    rows = [json.loads(line) for line in open(judged)]
    assert [(r["batch"], r["thread"]) for r in rows] == [(n, "scorer") for n in range(1, 5)]
    assert [r["next_sampled"] for r in rows] == [True, True, True, False]
    assert [r["objective/scores"] > 0 for r in read_metrics(out)] == [True] * 4


def test_eps_counts_the_wait_for_the_batches_in_flight_as_training():
    """An evaluation first waits for the batches --max_staleness has in flight (they share the reward models): that
    wait is sampling, training's time, and eps leaves out only the evaluation's own seconds."""
    from types import SimpleNamespace

    from infra.run import Run

    class Ahead:  # one batch in flight, sampled 0.5 s after the update's end
        pending = True

        def settle(self):
            if self.pending:
                time.sleep(0.5)
            self.pending = False

    def evaluate():  # as Run.evaluate: the batches in flight first, then the held-out completions (0.1 s)
        run.sampler.ahead.settle()
        time.sleep(0.1)

    args = SimpleNamespace(eval_every=16, batch_size=16, num_updates=4, checkpoint_every=0)
    sampler = SimpleNamespace(ahead=Ahead())
    run = SimpleNamespace(args=args, episode=32, sampler=sampler, eval_set=[], evaluate=evaluate, start_time=0.0)
    Run.evaluate_and_checkpoint(run, update=2)
    assert not sampler.ahead.pending
    assert 0.08 < run.start_time < 0.4  # the evaluation's 0.1 s left out of eps, not the 0.5 s of sampling


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--max_staleness 1 --dynamic_sampling", "with --dynamic_sampling"),
        ("--max_staleness -1", "--max_staleness must be at least 0, got -1"),
        ("--max_staleness 1 --weight_sync_steps 3", "--weight_sync_steps must be in [1, --max_staleness + 1 = 2]"),
        ("--weight_sync_steps 2", "--weight_sync_steps must be in [1, --max_staleness + 1 = 1]"),
    ],
)
def test_what_cannot_sample_ahead_is_refused_in_one_line(flags, message, run, tmp_path, tiny_model_dir, tiny_prompts_file):
    out = tmp_path / "out"
    proc = run(f"grpo.py {common(tiny_model_dir, tiny_prompts_file, out)} {flags}", cwd=tmp_path)
    assert proc.returncode != 0 and message in proc.stderr.strip().splitlines()[-1]
    assert not out.exists()


@pytest.mark.parametrize("sync", [1, 2])
def test_kill_then_resume_at_staleness_one(sync, run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """grpo.py --max_staleness 1 with an environment's episodes, killed with SIGKILL while it trains and resumed: the
    uninterrupted run's metrics (the batch in flight at the checkpoint is saved with it); also with the sampler given
    every second update's weights (--weight_sync_steps 2: batches 0 and 1 update old in turn)."""
    from test_environments import ENVS

    (tmp_path / "envs.py").write_text(ENVS)
    args = common(tiny_model_dir, tiny_prompts_file, "{}") + f" --environment {tmp_path}/envs.py:Echo --stop_token None"
    args += " --num_generations 2 --total_episodes 160 --learning_rate 3e-3 --max_staleness 1 --checkpoint_every 1"
    args += f" --weight_sync_steps {sync}"
    check_ok(run(f"grpo.py {args.format(tmp_path / 'full')}", cwd=tmp_path))
    expected = read_metrics(tmp_path / "full")
    ages = [0] + [1] * 9 if sync == 1 else [0, 1] * 5
    assert len(expected) == 10 and [r["async/staleness"] for r in expected] == ages and "env/turns" in expected[-1]

    cut = tmp_path / "cut"
    cmd = [sys.executable, os.path.join(REPO, "grpo.py"), *args.format(cut).split()]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert 3 <= kill_after_rows(proc, cut, 3) < 10
    check_ok(run(f"grpo.py {args.format(cut)} --resume", cwd=tmp_path))
    untimed = [{k: v for k, v in r.items() if k != "async/wait_s"} for r in without_eps(read_metrics(cut))]
    assert untimed == [{k: v for k, v in r.items() if k != "async/wait_s"} for r in without_eps(expected)]


def test_two_processes_match_one_at_staleness_one(tmp_path, runs):  # noqa: F811
    """grpo.py --max_staleness 1 on two processes (each with its own sampler thread), killed with SIGKILL after their
    second update and resumed (each process's batch in flight back from the checkpoint), against one process: the same
    metrics and the same saved model."""
    args = f"{runs['grpo.py']} --max_staleness 1 --checkpoint_every 1"
    one, two = tmp_path / "one", tmp_path / "two"
    check_ok(launch(1, "grpo.py", f"{args} --gradient_accumulation_steps 4 --output_dir {one}", tmp_path))
    cut = f"{args} --gradient_accumulation_steps 2 --output_dir {two}"
    assert kill_after_rows(launch(2, "grpo.py", cut, tmp_path, wait=False), two, 2, group=True) == 2
    proc = launch(2, "grpo.py", f"{cut} --resume", tmp_path)
    check_ok(proc)
    assert "world_size=2" in proc.stdout
    assert_same_run(one, two, "grpo.py")
    assert [r["async/staleness"] for r in read_metrics(two)] == [0, 1, 1]


def test_ppo_and_distill_sample_ahead(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """ppo.py and distill.py at --max_staleness 1: the batches' ages logged, and the correction's statistics on every
    sampled batch; distill.py at --lmbda 0.5 picks per update, as its synchronous run does, whether the student samples
    (weighed) or the dataset's completions stand in (no weight, the dataset's text logged)."""
    data = tmp_path / "data.jsonl"
    rows = [json.loads(line) for line in open(tiny_prompts_file)]
    lines = [json.dumps({"prompt": r["prompt"], "completion": f" number {i}"}) + "\n" for i, r in enumerate(rows)]
    data.write_text("".join(lines))
    base = common(tiny_model_dir, data, "{}") + " --total_episodes 96 --learning_rate 3e-3"
    check_ok(run(f"ppo.py {base.format(tmp_path / 'ppo')} --max_staleness 1", cwd=tmp_path))
    ppo = read_metrics(tmp_path / "ppo")
    assert [r["async/staleness"] for r in ppo] == [0, 1, 1, 1, 1, 1]
    assert all(r["vllm/logprob_diff_mean"] >= 0 for r in ppo) and ppo[-1]["vllm/logprob_diff_mean"] > 1e-4

    distill = f"distill.py {base} --teacher_model_name_or_path {tiny_model_dir} --lmbda 0.5 --log_completions"
    check_ok(run(distill.format(tmp_path / "sync"), cwd=tmp_path))
    check_ok(run(distill.format(tmp_path / "ahead") + " --max_staleness 1", cwd=tmp_path))
    sync, ahead = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "ahead")
    picked = [r["distill/on_policy"] for r in sync]
    assert [r["distill/on_policy"] for r in ahead] == picked and 0 < sum(picked) < 6
    assert [r["async/staleness"] for r in ahead] == [0, 1, 1, 1, 1, 1]
    assert [("vllm/logprob_diff_mean" in r) for r in ahead] == [bool(p) for p in picked]
    dataset = {r["prompt"]: f" number {i}" for i, r in enumerate(rows)}
    logged = [json.loads(line) for line in open(tmp_path / "ahead" / "completions.jsonl")]
    for update, on_policy in enumerate(picked, start=1):
        texts = [(c["prompt"], c["completion"]) for c in logged if c["update"] == update]
        assert len(texts) == 16 and all((c.strip() == dataset[p].strip()) != bool(on_policy) for p, c in texts), update


@needs_vllm
def test_a_vllm_engine_samples_ahead_with_the_weights_it_claims(tmp_path, tiny_llama_dir, tiny_prompts_file):
    """rloo.py --use_vllm --max_staleness 2: the engine samples each batch with the weights of the version it records
    (given the worker's copy): its logprobs, recorded as it sampled, are that version's (fp32: within 1e-4, as in a
    synchronous run), and the importance weights are a naive loop's with them as the behaviour."""
    (tmp_path / "reward.py").write_text(VOWELS)
    out = tmp_path / "out"
    args = common(tiny_llama_dir, tiny_prompts_file, out) + f" {EAGER} --rloo_k 4 --reward_fn {tmp_path}/reward.py:vowels"
    args += " --total_episodes 96 --learning_rate 3e-3 --max_staleness 2 --checkpoint_every 1 --keep_checkpoints 10"
    rec = probe_run("rloo.py", args, tmp_path)
    assert [r["async/staleness"] for r in read_metrics(out)] == [0, 1, 2, 2, 2, 2]
    assert [b.version for b in rec["batches"]] == [0, 0, 0, 1, 2, 3]
    for u, (batch, (start, weights, kw)) in enumerate(zip(rec["batches"], rec["weights"]), start=1):
        real = batch.sampled
        behaviour = naive_logprobs(weights_of(tiny_llama_dir, batch.version, out), batch, 1.0)
        torch.testing.assert_close(batch.behaviour_logprobs[real], behaviour[real], atol=1e-4, rtol=0)
        at_start = naive_logprobs(weights_of(tiny_llama_dir, u - 1, out), batch, 1.0)
        if u - 1 > batch.version:  # the engine had the old weights, not the policy's of the update's start
            assert (batch.behaviour_logprobs[real] - at_start[real]).abs().max() > 1e-2, u
        expected = torch.stack([(at_start[r] - behaviour[r])[real[r]].sum().exp().clamp(max=3.0) for r in range(len(real))])
        torch.testing.assert_close(weights, expected.float(), atol=1e-3, rtol=1e-3)


@needs_vllm
def test_with_vllm_ahead_two_processes_killed_and_resumed_match_one(tmp_path, tiny_llama_dir, tiny_prompts_file):
    """rloo.py --use_vllm --max_staleness 1: two processes, each with its engine sampling ahead, killed with SIGKILL
    while they train and resumed, give the uninterrupted one-process run's metrics and model."""
    from test_distributed import launch

    (tmp_path / "reward.py").write_text(VOWELS)
    args = common(tiny_llama_dir, tiny_prompts_file, "{}").replace("--per_device_train_batch_size 8", "")
    args += f" {EAGER} --rloo_k 4 --reward_fn {tmp_path}/reward.py:vowels --total_episodes 96"
    args += " --per_device_train_batch_size 4 --learning_rate 1e-3 --max_staleness 1 --checkpoint_every 1"
    args = args.replace(" --gradient_accumulation_steps 2", "")
    check_ok(launch(1, "rloo.py", f"{args.format(tmp_path / 'one')} --gradient_accumulation_steps 4", tmp_path))
    expected = read_metrics(tmp_path / "one")
    assert [r["async/staleness"] for r in expected] == [0, 1, 1, 1, 1, 1]

    cut = args.format(tmp_path / "cut") + " --gradient_accumulation_steps 2"
    proc = launch(2, "rloo.py", cut, tmp_path, wait=False)
    assert 3 <= kill_after_rows(proc, tmp_path / "cut", 3, group=True) < 6
    check_ok(launch(2, "rloo.py", f"{cut} --resume", tmp_path))
    assert_same_run(tmp_path / "one", tmp_path / "cut", "rloo.py")  # (the batches in flight came back from the checkpoint)
