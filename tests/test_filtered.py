"""Filtered fine-tuning: sft.py's --keep (offline) picks the rows a naive loop picks and then trains exactly as on those
rows alone, bad rewards are refused in one line; raft.py (online) keeps each prompt's best completion, as a naive loop
ranks them, takes no step when --min_score keeps nothing, and runs with LoRA in bf16."""

import json
import math
import random
import types

import datasets
import pytest
import torch
from safetensors.torch import load_file
from test_pipeline import write
from test_rloo import VOWELS, check_ok, read_metrics

import raft
import sft


def scored(prompts=6, per=4, seed=0):
    """per completions of each prompt with a reward, ties included (the first of equals is the best)"""
    rng = random.Random(seed)
    words = "sunny bright warm kind gentle happy calm glad".split()
    return [
        {"prompt": f"Describe day {i}.", "completion": f" It was {rng.choice(words)}.", "reward": rng.choice([0.0, 0.5, 1.0])}
        for i in range(prompts)
        for _ in range(per)
    ]  # fmt: skip


def naive_keep(rows, how, n, seed):
    if how == "best":
        best = {}
        for i, r in enumerate(rows):
            if r["prompt"] not in best or r["reward"] > rows[best[r["prompt"]]]["reward"]:
                best[r["prompt"]] = i
        return sorted(best.values())
    if how == "top":  # the n largest rewards, the earlier row first among equals
        return sorted(sorted(range(len(rows)), key=lambda i: (-rows[i]["reward"], i))[:n])
    return sorted(random.Random(seed).sample(range(len(rows)), n))


@pytest.mark.parametrize("how, keep_rows", [("best", None), ("top", None), ("top", 9), ("random", 5)])
def test_keep_picks_the_rows_a_naive_loop_picks(how, keep_rows):
    rows = scored()
    args = types.SimpleNamespace(keep=how, keep_rows=keep_rows, seed=3)
    got = sft.kept(datasets.Dataset.from_list(rows), args)
    want = naive_keep(rows, how, keep_rows or 6, 3)
    assert got.to_list() == [rows[i] for i in want]
    assert len(got) == (keep_rows or 6)


@pytest.mark.parametrize(
    "rows, keep, line",
    [
        ([{"prompt": "a", "completion": "b", "reward": math.nan}], "best", "row 0's `reward` must be a finite number"),
        ([{"prompt": "a", "completion": "b", "reward": "good"}], "top", "must be a finite number, got 'good'"),
        ([{"prompt": "a", "completion": "b"}], "top", "--keep top ranks rows by `reward` within `prompt`"),
        ([{"prompt": "a", "completion": "b", "reward": 1}], "top_2", "--keep_rows 2: the dataset has 1 rows"),
    ],
)
def test_bad_rewards_are_refused_in_one_line(rows, keep, line, capsys):
    """(sft.kept runs in infra.read_examples, before anything is written or any model loads)"""
    keep, _, count = keep.partition("_")
    args = types.SimpleNamespace(keep=keep, keep_rows=int(count) if count else None, seed=0)
    with pytest.raises(SystemExit):
        sft.kept(datasets.Dataset.from_list(rows), args)
    assert line in capsys.readouterr().err.strip().splitlines()[-1]


def test_keep_rows_without_a_count_to_keep_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit):
        sft.main(sft.Args(dataset_name=write(tmp_path / "rows.jsonl", scored(1)), keep_rows=2, output_dir=str(out)))
    assert "--keep_rows counts the rows --keep top or random keeps" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not out.exists()


def test_keep_best_trains_as_on_the_best_rows_alone(run, tmp_path, tiny_model_dir):
    """--keep best on 6 prompts x 4 scored completions: the same updates, metrics and weights as a run on the 6 rows a
    naive loop picks"""
    rows = scored()
    flags = f"--model_name_or_path {tiny_model_dir} --per_device_train_batch_size 2 --gradient_accumulation_steps 1 --seed 5"
    outs = {}
    for name, data, keep in [("keep", rows, "best"), ("picked", [rows[i] for i in naive_keep(rows, "best", 6, 0)], "all")]:
        outs[name] = tmp_path / name
        path = write(tmp_path / f"{name}.jsonl", data)
        check_ok(run(f"sft.py {flags} --dataset_name {path} --keep {keep} --output_dir {outs[name]}", tmp_path))
    a, b = read_metrics(outs["keep"]), read_metrics(outs["picked"])
    assert len(a) == 3 and [r["loss/sft"] for r in a] == [r["loss/sft"] for r in b]
    weights = [load_file(outs[n] / "model.safetensors") for n in ("keep", "picked")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.parametrize("min_score", [None, 1.0])
def test_best_of_group_is_a_naive_loop(min_score):
    torch.manual_seed(0)
    k, prompts = 4, 50
    scores = torch.randint(0, 3, (prompts * k,)).float()  # ties
    scored = torch.rand(prompts * k) > 0.2
    scored[:k] = False  # a prompt none of whose completions was scored
    best, learnt = raft.best_of_group(scores, scored, k, min_score)
    for j in range(prompts):
        rows = [j * k + i for i in range(k) if scored[j * k + i]]
        top = max((scores[r] for r in rows), default=None)
        assert bool(learnt[j]) == (bool(rows) and (min_score is None or top >= min_score))
        if rows:
            assert int(best[j]) == next(r for r in rows if scores[r] == top)


def test_raft_learns_each_prompts_best_completion_steps_on_nothing_below_min_score_and_runs_lora_in_bf16(
    run, tmp_path, tiny_model_dir, tiny_prompts_file
):
    """--log_completions: in every update, the one completion of each prompt marked learnt (advantage 1) is its best
    scored; --min_score above every score: no step, the saved weights are the initial ones; LoRA in bf16 runs"""
    (tmp_path / "reward.py").write_text(VOWELS)
    flags = (
        f"--model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --reward_fn {tmp_path}/reward.py:vowels"
        " --num_generations 4 --per_device_train_batch_size 8 --total_episodes 32 --response_length 8 --temperature 1"
        " --learning_rate 1e-3 --num_sample_generations 0"
    )
    out = tmp_path / "out"
    check_ok(run(f"raft.py {flags} --log_completions --output_dir {out}", tmp_path))
    rows = [json.loads(line) for line in open(out / "completions.jsonl")]
    assert len(rows) == 32
    for start in range(0, 32, 4):  # each prompt's 4 completions, in order
        group = rows[start : start + 4]
        assert len({r["prompt"] for r in group}) == 1
        best = max(range(4), key=lambda i: (group[i]["score"], -i))
        assert [r["advantage"] for r in group] == [1.0 if i == best else 0.0 for i in range(4)]
    metrics = [r for r in read_metrics(out) if "raft/kept_fraction" in r]
    assert [r["raft/kept_fraction"] for r in metrics] == [1.0, 1.0]
    start = load_file(f"{tiny_model_dir}/model.safetensors")
    assert any(not torch.equal(v, start[k]) for k, v in load_file(out / "model.safetensors").items())

    none = tmp_path / "none"  # (with weight decay, which a step would apply)
    check_ok(run(f"raft.py {flags} --min_score 1000 --weight_decay 0.1 --output_dir {none}", tmp_path))
    assert [r["raft/kept_fraction"] for r in read_metrics(none) if "raft/kept_fraction" in r] == [0.0, 0.0]
    assert all(torch.equal(v, start[k]) for k, v in load_file(none / "model.safetensors").items())

    lora = tmp_path / "lora"
    check_ok(run(f"raft.py {flags} --use_peft --bf16 --output_dir {lora}", tmp_path))
    rows = read_metrics(lora)
    assert len(rows) == 2 and all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert (lora / "adapter_model.safetensors").exists()
