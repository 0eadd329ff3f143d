"""The KL estimators abs and full (utils.kl_estimate, utils.full_kl) and PPO's critic warm-up (--critic_warmup_updates):
formulas against naive loops, then runs as a user would on the tiny offline models."""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from test_rloo import VOWELS, check_ok, read_metrics  # noqa: E402

import utils  # noqa: E402


def naive_full_kl(logits, ref_logits, temperature):
    """KL(p || q) of softmax(logits / temperature) and softmax(ref_logits / temperature), one position at a time, in
    float64, skipping tokens the policy gives no probability (0 log 0 = 0)."""
    batch, seq, vocab = logits.shape
    out = torch.zeros(batch, seq, dtype=torch.float64)
    for b in range(batch):
        for t in range(seq):
            p = torch.softmax(logits[b, t].double() / temperature, -1)
            q = torch.softmax(ref_logits[b, t].double() / temperature, -1)
            out[b, t] = sum(p[v] * (p[v].log() - q[v].log()) for v in range(vocab) if p[v] > 0)
    return out


# budgets: one position of one row per chunk (smaller than the vocabulary), 3 positions (splitting each row's 7), two
# whole rows per chunk (splitting the batch of 3), and the default (everything in one chunk)
@pytest.mark.parametrize("budget", [5, 3 * 11, 2 * 7 * 11, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_kl_matches_a_per_position_loop(budget, dtype):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 7, 11, generator=g)).to(dtype)
    ref_logits = (3 * torch.randn(3, 7, 11, generator=g)).to(dtype)
    # a token both models rule out, as a masked vocabulary entry would be: it adds nothing (not NaN)
    logits[0, 2, 4] = ref_logits[0, 2, 4] = -math.inf
    # padding: whatever the logits hold there stays there, and the scripts mask it out as for the other estimators
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[1, 5:] = padding[2, 3:] = True
    logits[padding] = math.nan
    kl = utils.full_kl(logits, ref_logits, temperature=0.7, budget=budget)
    assert kl.shape == (3, 7) and kl.dtype == torch.float32
    assert kl[padding].isnan().all() and kl[~padding].isfinite().all()  # no chunk mixes positions
    expected = naive_full_kl(logits, ref_logits, 0.7)
    torch.testing.assert_close(kl.masked_fill(padding, 0.0), expected.float().masked_fill(padding, 0.0), atol=1e-5, rtol=1e-5)
    assert (kl[~padding] > 0).all()
    # the temperature matters: at temperature 1 the distributions, and so the KL, differ
    assert not torch.allclose(utils.full_kl(logits, ref_logits, 1.0, budget)[~padding], kl[~padding])
    # a policy equal to the reference: exactly 0, where k1 on samples would scatter around it
    assert torch.equal(utils.full_kl(ref_logits, ref_logits, 0.7, budget), torch.zeros(3, 7))


def test_abs_estimator_value_and_its_gradient_in_the_loss():
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    expected = [abs(a - b) for a, b in zip(logp.tolist(), ref.tolist())]
    torch.testing.assert_close(utils.kl_estimate(logp, ref, "abs"), torch.tensor(expected))
    # --kl_penalty loss --kl_estimator abs: in expectation over tokens from the policy, its gradient is that of twice
    # the total variation distance sum |p - q|, a true divergence (not a KL, but pulling the policy to the reference)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, generator=g, requires_grad=True)
    q = torch.softmax(torch.randn(6, generator=g), 0)
    logp = torch.log_softmax(logits, 0)
    p = logp.exp().detach()
    (grad,) = torch.autograd.grad((p * utils.kl_estimate(logp, q.log(), "abs")).sum(), logits)
    (tv_grad,) = torch.autograd.grad((torch.softmax(logits, 0) - q).abs().sum(), logits)
    torch.testing.assert_close(grad, tv_grad)
    assert grad.abs().max() > 0.01


def run_args(script, model_dir, prompts, out, extra):
    return (
        f"{script} --model_name_or_path {model_dir} --dataset_name {prompts} --output_dir {out} --response_length 6"
        " --total_episodes 16 --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --learning_rate 1e-3"
        " --temperature 1.0 --num_sample_generations 0 --no_save_model" + extra
    )


def test_full_kl_in_ppo_and_rloo_runs(run, tmp_path, eos_model_dir, tiny_prompts_file):
    """--kl_estimator full end to end (the model stops early, so rows have padding): at the first update the policy is
    the reference, so the exact KL is exactly 0; after a step it is positive. PPO with k1 instead samples the same
    completions at update 2 (the first update was the same, the KL being 0 in both) but measures another KL."""
    (tmp_path / "reward.py").write_text(VOWELS)
    extra = f" --reward_fn {tmp_path}/reward.py:vowels --kl_coef 0.1"
    rows = {}
    for script, kind in [("ppo.py", "full"), ("ppo.py", "k1"), ("rloo.py", "full")]:
        out = tmp_path / f"{script}_{kind}"
        check_ok(run(run_args(script, eos_model_dir, tiny_prompts_file, out, extra + f" --kl_estimator {kind}"), tmp_path))
        rows[script, kind] = read_metrics(out)
    for key in [("ppo.py", "full"), ("rloo.py", "full")]:
        first, second = rows[key]
        assert first["objective/kl"] == 0.0 and second["objective/kl"] > 0.0, key
        assert first["val/response_length"] < 6  # some completions stopped: padding was masked out
    (_, full), (_, k1) = rows["ppo.py", "full"], rows["ppo.py", "k1"]
    assert full["objective/entropy"] == k1["objective/entropy"]  # the same completions, scored alike
    assert full["objective/scores"] == k1["objective/scores"]
    assert full["objective/kl"] != k1["objective/kl"]
    assert full["objective/non_score_reward"] == pytest.approx(-0.1 * full["objective/kl"], rel=1e-5)


def test_critic_warmup_holds_the_policy_then_trains_it(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """--critic_warmup_updates 1 in a 2-update run: after update 1 the policy's weights are exactly the initial ones
    and AdamW holds no state for them (its first step after the warm-up is Adam's first), while the critic learnt;
    after update 2 the policy has moved."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    (tmp_path / "reward.py").write_text(VOWELS)
    out = tmp_path / "out"
    extra = f" --reward_fn {tmp_path}/reward.py:vowels --critic_warmup_updates 1 --checkpoint_every 1"
    check_ok(run(run_args("ppo.py", tiny_model_dir, tiny_prompts_file, out, extra), tmp_path))
    assert [r["policy/critic_warmup"] for r in read_metrics(out)] == [1.0, 0.0]

    # the initial weights under the names transformers gives them now (the ones the checkpoint holds)
    initial = {k: v.detach() for k, v in AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters()}
    n_policy = len(initial)
    weights, optimizer_state = {}, {}
    for update in (1, 2):
        path = out / f"checkpoint-{update:07d}"
        weights[update] = load_file(path / "model.safetensors")
        optimizer_state[update] = torch.load(path / "optimizer.bin", weights_only=True)["state"]  # (accelerate's name)
    n_critic = len([k for k in weights[1] if k.startswith("critic.")])
    for name, value in initial.items():
        assert torch.equal(weights[1]["policy." + name], value), name
    assert any(not torch.equal(weights[2]["policy." + name], value) for name, value in initial.items())
    # the critic (the policy's trunk with a new head) learnt in update 1
    trunk = {k: v for k, v in initial.items() if k.startswith("gpt_neox.")}
    assert any(not torch.equal(weights[1]["critic." + name], value) for name, value in trunk.items())
    # after update 1 AdamW holds state for the critic's parameters alone; after update 2 for all, the policy's after one
    # step, the critic's after two (the parameter groups, decayed or not, interleave the two models' indices)
    assert len(optimizer_state[1]) == n_critic and all(s["step"].item() == 1.0 for s in optimizer_state[1].values())
    steps = sorted(s["step"].item() for s in optimizer_state[2].values())
    assert steps == [1.0] * n_policy + [2.0] * n_critic
    assert all(optimizer_state[2][i]["step"].item() == 2.0 for i in optimizer_state[1])  # the same parameters: the critic's


@pytest.mark.parametrize(
    "script, flags, message",
    [
        ("ppo.py", "--kl_penalty loss --kl_estimator full", "--kl_penalty loss cannot use --kl_estimator full"),
        ("ppo_tldr.py", "--kl_penalty loss --kl_estimator full", "--kl_penalty loss cannot use --kl_estimator full"),
        ("ppo.py", "--critic_warmup_updates 24", "--critic_warmup_updates must be >= 0 and below the run's 24 updates"),
        ("ppo.py", "--critic_warmup_updates 1 --value_head_shared", "--critic_warmup_updates needs a separate critic"),
    ],
)
def test_bad_flags_are_refused_before_loading_anything(run, tmp_path, script, flags, message):
    # the model path holds no model: the flags are refused before any model is looked for
    model_flag = "--model_name_or_path" if script == "ppo.py" else "--sft_model_path"
    (tmp_path / "empty").mkdir()
    proc = run(f"{script} {model_flag} {tmp_path / 'empty'} --output_dir {tmp_path / 'out'} {flags}", cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: " + message), proc.stderr[-2000:]
