"""Held-out evaluation in rloo.py, grpo.py and ppo.py (--eval_dataset_name): what a run writes against an independent
recomputation (the saved model's greedy completions from plain transformers, each reward source's score by hand,
mean@k and pass@k from the written samples), and the refusals. Several processes, DeepSpeed and resume with the
evaluation: tests/test_distributed.py."""

import json
import os

import pytest
import torch
from test_rloo import check_ok, read_metrics

# neither source judges the completions of prompts about a storm or a bridge (None): they are unscored
REWARDS = """
def anything(completions, **kwargs):  # (TRL's form: it may read any column)
    return [0.0 for c in completions]

def vowels(prompts, completions):
    return [None if "storm" in p or "bridge" in p else sum(ch in "aeiou" for ch in c) / max(1, len(c))
            for p, c in zip(prompts, completions)]

def near(prompts, completions, target):
    return [None if "storm" in p or "bridge" in p else -abs(len(c) - t) / 10
            for p, c, t in zip(prompts, completions, target)]
"""
UNSCORED = ("storm", "bridge")
HELD_OUT = ["Tell me about the harbour", "Describe a storm", "Explain the bridge", "Write a poem about snow",
            "Give advice on the forest", "Share a fact about the moon", "Ask a question about a red kite"]  # fmt: skip


def vowels(c):
    return sum(ch in "aeiou" for ch in c) / max(1, len(c))


@pytest.mark.parametrize("script", ["rloo.py", "grpo.py", "ppo.py"])
def test_held_out_evaluation_matches_a_recomputation(script, run, tmp_path, tiny_model_dir, tiny_prompts_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rewards = REWARDS
    if script == "rloo.py":  # the evaluation made slow: its time is no part of eps, the rate of training
        slow = "    import time\n    time.sleep(0.5 if 30 in target else 0.0)\n"
        rewards = REWARDS.replace(
            "def near(prompts, completions, target):\n", "def near(prompts, completions, target):\n" + slow
        )
    (tmp_path / "rewards.py").write_text(rewards)
    with open(tiny_prompts_file) as f:  # the training prompts, with the column the second reward reads (and one that
        train = [{**json.loads(line), "target": 20, "id": i} for i, line in enumerate(f)]  # none reads, not held out)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps({"prompt": p, "target": 30}) + "\n" for p in HELD_OUT))
    k = {"rloo.py": "--rloo_k 2", "grpo.py": "--num_generations 2", "ppo.py": ""}[script]
    out = tmp_path / "out"
    check_ok(
        run(
            f"{script} {k} --model_name_or_path {tiny_model_dir} --dataset_name {tmp_path}/train.jsonl --output_dir {out}"
            f" --reward_fn {tmp_path}/rewards.py:vowels --reward_fn {tmp_path}/rewards.py:near --reward_weights 1 0.5"
            " --total_episodes 48 --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --learning_rate 1e-2"
            " --response_length 10 --temperature 1.0 --num_sample_generations 0"
            f" --eval_dataset_name {tmp_path}/held_out.jsonl --eval_every 32 --num_eval_generations 3 --eval_batch_size 3",
            cwd=tmp_path,
        )
    )
    rows = [r for r in read_metrics(out) if "eval/scores" in r]
    assert [r["episode"] for r in rows] == [0, 32, 48]  # before training, every 32 episodes, at the end
    assert rows == json.load(open(out / "eval.json"))
    assert rows[0]["eval/scores"] != rows[-1]["eval/scores"]  # the policy moved between them
    if script == "rloo.py":  # the third update's seconds of training: episodes over eps, less the first two's
        second, third = [r for r in read_metrics(out) if "eps" in r][1:]
        assert 48 / third["eps"] - 32 / second["eps"] < 1.0  # (the evaluation between them sleeps 0.5 s a call)

    # the last evaluation is the saved model's: its greedy completions, from plain transformers, prompt by prompt
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    samples = [json.loads(line) for line in open(out / "eval_samples" / "episode_48.jsonl")]
    assert [s["prompt"] for s in samples] == HELD_OUT
    scores = []
    for prompt, sample in zip(HELD_OUT, samples):
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            new = model.generate(ids, do_sample=False, max_new_tokens=10, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:]  # fmt: skip
        text = tokenizer.decode(new, skip_special_tokens=True)
        assert sample["completion"] == text.strip()
        assert len(sample["samples"]) == 3 and len({x["completion"] for x in sample["samples"]}) > 1  # sampled, not greedy
        if any(word in prompt for word in UNSCORED):  # no source scored it: no score, in no mean
            assert sample["score"] is None and all(x["score"] is None for x in sample["samples"])
            continue
        rewards = {"vowels": vowels(text), "near": -abs(len(text) - 30) / 10}  # the target of the held-out rows
        assert sample["rewards"] == pytest.approx(rewards)
        assert sample["score"] == pytest.approx(rewards["vowels"] + 0.5 * rewards["near"])
        scores.append(sample["score"])
    scored = [s for s in samples if s["score"] is not None]
    last = rows[-1]
    assert len(scores) == len(scored) == len(HELD_OUT) - 2 and last["eval/unscored"] == 2
    assert last["eval/scores"] == pytest.approx(sum(scores) / len(scores))
    assert last["eval/rewards/vowels"] == pytest.approx(sum(s["rewards"]["vowels"] for s in scored) / len(scored))
    # mean@3: the mean over every scored sample; pass@3: the mean over prompts of the best sample
    assert last["eval/mean@3"] == pytest.approx(sum(x["score"] for s in scored for x in s["samples"]) / (3 * len(scored)))
    assert last["eval/pass@3"] == pytest.approx(sum(max(x["score"] for x in s["samples"]) for s in scored) / len(scored))
    assert last["eval/pass@3"] > last["eval/mean@3"]
    # TensorBoard has the evaluation too
    assert os.listdir(out / "runs")


def test_evaluation_refusals_are_one_line(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """Before any work: a held-out set without a column a reward function reads (one it names; any, for one taking
    **kwargs), a bad --eval_every or one without a held-out set, a missing file."""
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "Describe the sea", "target": 3}) + "\n")
    lacks = "error: --eval_dataset_name lacks the column(s) ['target'], which reward function"
    for reward, extra, expected in [
        ("near", f"--eval_dataset_name {tiny_prompts_file} --eval_every -1", "error: --eval_every must be at least 0, got -1"),
        ("near", f"--eval_dataset_name {tiny_prompts_file}", f"{lacks} '{tmp_path}/rewards.py:near'"),
        ("anything", f"--eval_dataset_name {tiny_prompts_file}", f"{lacks} '{tmp_path}/rewards.py:anything'"),
        ("near", "--eval_dataset_name missing.jsonl", "error: --eval_dataset_name 'missing.jsonl' does not exist"),
        ("near", "--eval_every 8", "error: --eval_every needs --eval_dataset_name, the held-out prompts it evaluates"),
    ]:
        data = f"--dataset_name {tmp_path}/train.jsonl --reward_fn {tmp_path}/rewards.py:{reward}"
        proc = run(f"rloo.py --model_name_or_path {tiny_model_dir} {data} {extra} --output_dir {tmp_path}/out", cwd=tmp_path)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode != 0 and last.startswith(expected), last
        assert not os.path.exists(tmp_path / "out")  # refused before any work
