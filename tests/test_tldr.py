"""rloo_tldr.py and ppo_tldr.py on a TL;DR-shaped mini dataset: training, the reward-model evaluation, its samples."""

import json
import os

import pytest
from test_rloo import KEYS as RLOO_KEYS
from test_rloo import TRL_KEYS, check_ok, read_metrics, reward_keys

PPO_KEYS = RLOO_KEYS + ["loss/value_avg", "val/clipfrac_avg", "val/vpred", "objective/kl_coef"]
EVAL_KEYS = ["episode", "eval/scores", "eval/unscored", "eval/response_length", "eval/stopped_fraction"]


def datasets_rows(tldr_dir, split):
    import datasets

    return datasets.load_dataset(tldr_dir, split=split).to_list()


def validation_rows(tldr_dir):
    return datasets_rows(tldr_dir, "validation")


def read_samples(out, episode):
    with open(os.path.join(out, "eval_samples", f"episode_{episode}.jsonl")) as f:
        return [json.loads(line) for line in f]


def recompute_eval(policy, tok, rm, samples, response_length=12, keep_last=None):
    """Check eval_samples rows against plain transformers, one prompt at a time: greedy generate() cut after the EOS
    token, and the reward model's own pooled score of prompt + completion; with keep_last, from the prompt's last
    keep_last tokens. Returns the recomputed completions."""
    import torch

    completions = []
    for s in samples:
        ids = tok(s["prompt"], return_tensors="pt", add_special_tokens=False)["input_ids"]
        ids = ids[:, -keep_last:] if keep_last else ids
        with torch.no_grad():
            full = policy.generate(
                input_ids=ids,
                do_sample=False,
                max_new_tokens=response_length,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )[0]
            response = full[ids.shape[1] :]
            if (response == tok.eos_token_id).any():
                response = response[: int((response == tok.eos_token_id).nonzero()[0]) + 1]
            score = rm(torch.cat([ids[0], response])[None]).logits[0, 0].item()
        completions.append(tok.decode(response, skip_special_tokens=True).strip())
        assert s["completion"] == completions[-1]
        assert s["length"] == len(response) and s["stopped"] == bool((response == tok.eos_token_id).any())
        assert s["score"] == pytest.approx(score, abs=1e-4)
    return completions


def small(script, tldr_dir, model, reward_model, out, extra=""):
    """A run of a TL;DR script small enough for a test: 2 updates of 16 completions, 10 eval prompts."""
    return (
        f"{script} --sft_model_path {model} --reward_model_path {reward_model} --dataset_name {tldr_dir}"
        " --max_prompt_length 200 --response_length 12 --total_episodes 32 --per_device_train_batch_size 4"
        " --gradient_accumulation_steps 2 --num_mini_batches 2 --num_ppo_epochs 2 --local_rollout_forward_batch_size 16"
        f" --eval_examples 10 --eval_batch_size 4 --num_sample_generations 0 --output_dir {out} {extra}"
    )


def test_rloo_tldr_trains_and_evaluates(run, tmp_path, tldr_dir, tiny_model_dir, tiny_reward_model_dir):
    out = tmp_path / "out"
    proc = run(small("rloo_tldr.py", tldr_dir, tiny_model_dir, tiny_reward_model_dir, out, "--eval_every 16"), tmp_path)
    check_ok(proc)
    rows = read_metrics(out)
    train = [r for r in rows if "objective/scores" in r]
    evals = [r for r in rows if "eval/scores" in r]
    rm_keys = reward_keys(os.path.basename(tiny_reward_model_dir))  # the reward model's rewards/<name>/...
    assert [r["episode"] for r in train] == [16, 32]
    assert all(sorted(r) == sorted(RLOO_KEYS + TRL_KEYS + rm_keys) for r in train)
    assert [r["episode"] for r in evals] == [0, 16, 32] and all(sorted(r) == sorted(EVAL_KEYS) for r in evals)
    # the schedule steps once per update (TRL 0.x's RLOOTrainer), though an update takes 4 optimiser steps here
    assert [r["lr"] for r in train] == pytest.approx([3e-6, 1.5e-6])
    with open(out / "eval.json") as f:
        assert json.load(f) == evals

    # the samples tools/judge_tldr.py reads: the first 10 eval prompts with their references
    reference = validation_rows(tldr_dir)[:10]
    for row in evals:
        samples = read_samples(out, row["episode"])
        assert [s["index"] for s in samples] == list(range(10))
        assert [s["prompt"] for s in samples] == [r["prompt"] for r in reference]
        assert [s["reference"] for s in samples] == [r["completion"].strip() for r in reference]
        assert row["eval/scores"] == pytest.approx(sum(s["score"] for s in samples) / 10)
    assert f"tools/judge_tldr.py --samples {out}" in proc.stdout

    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size > 0
    card = (out / "README.md").read_text()  # the model card, whose final metrics include the last evaluation's
    assert "- **Algorithm:** RLOO (`rloo_tldr.py`)" in card and f"| eval/scores | {evals[-1]['eval/scores']:.6g} |" in card


def test_eval_matches_transformers_greedy_and_reward_model(run, tmp_path, tldr_dir, tiny_model_dir, tiny_reward_model_dir):
    """The episode-0 evaluation, recomputed one prompt at a time with plain transformers: greedy generate() and the
    reward model's own pooled score."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "out"
    proc = run(small("rloo_tldr.py", tldr_dir, tiny_model_dir, tiny_reward_model_dir, out, "--total_episodes 16"), tmp_path)
    check_ok(proc)
    evals = [r for r in read_metrics(out) if "eval/scores" in r]
    assert [r["episode"] for r in evals] == [0, 16] and all(sorted(r) == sorted(EVAL_KEYS) for r in evals)

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
    samples = read_samples(out, 0)
    recompute_eval(policy, tok, rm, samples)
    assert evals[0]["eval/scores"] == pytest.approx(sum(s["score"] for s in samples) / len(samples))


def test_ppo_tldr_trains_evaluates_and_saves_the_critic(run, tmp_path, tldr_dir, tiny_model_dir, tiny_reward_model_dir):
    out = tmp_path / "out"
    check_ok(run(small("ppo_tldr.py", tldr_dir, tiny_model_dir, tiny_reward_model_dir, out), tmp_path))
    rows = read_metrics(out)
    train = [r for r in rows if "objective/scores" in r]
    evals = [r for r in rows if "eval/scores" in r]
    rm_keys = reward_keys(os.path.basename(tiny_reward_model_dir))
    assert [r["episode"] for r in train] == [16, 32] and all(sorted(r) == sorted(PPO_KEYS + rm_keys) for r in train)
    assert [r["episode"] for r in evals] == [0, 32] and all(sorted(r) == sorted(EVAL_KEYS) for r in evals)
    assert [s["index"] for s in read_samples(out, 32)] == list(range(10))
    assert os.path.exists(out / "critic" / "model.safetensors")
    assert "- **Algorithm:** PPO (`ppo_tldr.py`)" in (out / "README.md").read_text()  # the model card


def test_tldr_adds_weighted_sources_to_its_reward_model(run, tmp_path, tldr_dir, tiny_model_dir, tiny_reward_model_dir):
    """The TL;DR reward model is the first reward source; a function reading a dataset column joins it with a weight,
    while the evaluation stays the reward model's alone."""
    (tmp_path / "r.py").write_text(
        "def ref_length(prompts, completions, completion):\n    return [len(c) for c in completion]\n"
    )
    out = tmp_path / "out"
    extra = f"--total_episodes 16 --reward_fn {tmp_path}/r.py:ref_length --reward_weights 1 0.5 --log_completions"
    extra += " --missing_eos_penalty 0"  # the score is then the weighted sum alone
    check_ok(run(small("rloo_tldr.py", tldr_dir, tiny_model_dir, tiny_reward_model_dir, out, extra), tmp_path))
    name = os.path.basename(tiny_reward_model_dir)
    references = {r["prompt"]: r["completion"] for r in datasets_rows(tldr_dir, "train")}
    with open(out / "completions.jsonl") as f:
        logged = [json.loads(line) for line in f]
    assert len(logged) == 16
    for r in logged:  # the `completion` column is the dataset's reference summary, as it is stored
        assert r["rewards/ref_length"] == len(references[r["prompt"]])
        assert r["score"] == pytest.approx(r[f"rewards/{name}"] + 0.5 * r["rewards/ref_length"], abs=1e-4)
    (row,) = [m for m in read_metrics(out) if "objective/scores" in m]
    assert row["objective/scores"] == pytest.approx(sum(r["score"] for r in logged) / 16, abs=1e-4)
    evals = [m for m in read_metrics(out) if "eval/scores" in m]
    assert evals[0]["eval/scores"] == pytest.approx(sum(s["score"] for s in read_samples(out, 0)) / 10)


def test_long_eval_prompts_are_dropped_or_truncated(run, tmp_path, tldr_dir, tiny_model_dir, tiny_reward_model_dir):
    """--eval_long_prompts drop leaves the prompts over --max_prompt_length out of the eval set; truncate keeps the
    first eval_examples prompts, each summarised from its last max_prompt_length tokens (recomputed with plain
    transformers) and recorded with its whole text."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    reference = validation_rows(tldr_dir)[:10]
    sizes = [len(tok(r["prompt"], add_special_tokens=False)["input_ids"]) for r in reference]
    limit = sorted(sizes)[5]  # about half of the first 10 are longer
    kept = [r["prompt"] for r, n in zip(reference, sizes) if n <= limit]
    assert 0 < len(kept) < 10

    samples = {}
    for mode in ("drop", "truncate"):
        out = tmp_path / mode
        extra = f"--total_episodes 16 --eval_long_prompts {mode}"
        command = small("rloo_tldr.py", tldr_dir, tiny_model_dir, tiny_reward_model_dir, out, extra)
        check_ok(run(command.replace("--max_prompt_length 200", f"--max_prompt_length {limit}"), tmp_path))
        samples[mode] = read_samples(out, 0)
    # drop: the long ones are missing (the eval set is the first 10 of what is left)
    assert [s["prompt"] for s in samples["drop"]][: len(kept)] == kept
    assert not any(n > limit and s["prompt"] == r["prompt"] for s in samples["drop"] for r, n in zip(reference, sizes))
    # truncate: the first 10, whole texts, each summarised from the end of its prompt
    assert [s["prompt"] for s in samples["truncate"]] == [r["prompt"] for r in reference]
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
    recompute_eval(policy, tok, rm, samples["truncate"], keep_last=limit)


def test_resumed_run_lists_each_evaluation_once(run, tmp_path, tldr_dir, tiny_model_dir, tiny_reward_model_dir):
    import shutil

    out = tmp_path / "out"
    command = small(
        "rloo_tldr.py", tldr_dir, tiny_model_dir, tiny_reward_model_dir, out, "--eval_every 16 --checkpoint_every 1"
    )
    check_ok(run(command, tmp_path))
    shutil.rmtree(out / "checkpoint-0000002")  # as if the run had died after its first checkpoint
    check_ok(run(command + " --resume", tmp_path))
    with open(out / "eval.json") as f:
        assert [r["episode"] for r in json.load(f)] == [0, 16, 32]
    assert [r["episode"] for r in read_metrics(out)] == [0, 16, 16, 32, 32]


@pytest.mark.parametrize(
    "case, message",
    [
        ("no_reference_column", "no column 'summary'"),
        ("no_eval_split", "split 'test'"),
        ("reward_model_missing", "does not exist"),
    ],
)
def test_bad_input_is_one_clear_line_before_any_work(
    run, tmp_path, tldr_dir, tiny_model_dir, tiny_reward_model_dir, case, message
):
    extra = {
        "no_reference_column": "--reference_field summary",
        "no_eval_split": "--eval_split test",
        "reward_model_missing": "",
    }[case]
    reward_model = tmp_path / "nowhere" if case == "reward_model_missing" else tiny_reward_model_dir
    out = tmp_path / "out"
    proc = run(small("rloo_tldr.py", tldr_dir, tiny_model_dir, reward_model, out, extra), tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and message in last, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(out / "metrics.jsonl")


def test_two_processes_shard_the_evaluation(tmp_path, tldr_dir, tiny_model_dir, tiny_reward_model_dir):
    from test_distributed import launch

    out = tmp_path / "out"
    script, args = small("rloo_tldr.py", tldr_dir, tiny_model_dir, tiny_reward_model_dir, out).split(" ", 1)
    check_ok(launch(2, script, args, tmp_path))
    rows = read_metrics(out)
    # 32 episodes = one update of 2 processes x 16 completions; each row written once
    assert [r["episode"] for r in rows] == [0, 32, 32]
    reference = validation_rows(tldr_dir)[:10]
    for episode in (0, 32):
        samples = read_samples(out, episode)  # gathered from both processes, in the eval set's order
        assert [s["index"] for s in samples] == list(range(10))
        assert [s["prompt"] for s in samples] == [r["prompt"] for r in reference]
