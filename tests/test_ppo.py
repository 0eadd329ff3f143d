"""ppo.py: its formulas against naive references, then runs as a user would on the tiny offline models."""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from test_rloo import KEYS, VOWELS, check_ok, read_metrics, reward_keys  # noqa: E402

from ppo import adaptive_kl_coef, compute_gae, place_scores, value_loss  # noqa: E402

PPO_KEYS = KEYS + ["loss/value_avg", "val/clipfrac_avg", "val/vpred", "objective/kl_coef"]


def gae_reference(rewards, values, lengths, gamma, lam):
    """Textbook GAE, one row at a time over its real tokens only; the value after the last token is 0."""
    advantages = torch.zeros_like(rewards)
    for b, n in enumerate(lengths):
        running = 0.0
        for t in reversed(range(n)):
            next_value = values[b, t + 1].item() if t + 1 < n else 0.0
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            running = delta + gamma * lam * running
            advantages[b, t] = running
    return advantages


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0)])
def test_gae_matches_a_per_row_loop(gamma, lam):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 2, 7, 1]
    mask = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]
    rewards = torch.randn(4, 7, generator=g).masked_fill(~mask, 0.0)
    values = torch.randn(4, 7, generator=g).masked_fill(~mask, 0.0)  # the script zeroes values past the end too
    advantages, returns = compute_gae(rewards, values, gamma, lam)
    expected = gae_reference(rewards, values, lengths, gamma, lam)
    torch.testing.assert_close(advantages.masked_fill(~mask, 0.0), expected)
    torch.testing.assert_close(returns, advantages + values)
    # gamma = lam = 1: the advantage is the sum of future rewards minus the value
    if gamma == lam == 1.0:
        future = rewards.flip(1).cumsum(1).flip(1)
        torch.testing.assert_close(advantages.masked_fill(~mask, 0.0), (future - values).masked_fill(~mask, 0.0))


def test_value_loss_clips_around_the_rollout_value():
    values = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0, -1.0]])
    vpred = torch.tensor([[0.5, 0.1, 0.5]])
    mask = torch.tensor([[True, True, True]])
    loss, clipfrac = value_loss(vpred, values, returns, mask, cliprange_value=0.2)
    # position 0: clipped to 0.2 -> (0.2-1)^2 = 0.64 beats (0.5-1)^2 = 0.25; position 1: inside the range, 0.81;
    # position 2: clipped to 0.2 -> 1.44 < (0.5+1)^2 = 2.25, so the unclipped loss is kept
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 2.25) / 3)
    assert clipfrac.item() == pytest.approx(1 / 3)
    # masked positions do not count
    loss, _ = value_loss(vpred, values, returns, torch.tensor([[True, True, False]]), cliprange_value=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81) / 2)


@pytest.mark.parametrize("kl, expected_error", [(6.0, 0.2), (5.5, 0.1), (4.0, -0.2), (4.9, -0.02)])
def test_adaptive_kl_controller_closed_form(kl, expected_error):
    # Ziegler et al.: e = clip(KL / target - 1, -0.2, 0.2); beta <- beta * (1 + e * n / horizon)
    assert adaptive_kl_coef(0.1, kl, 5.0, 10000, 512) == pytest.approx(0.1 * (1 + expected_error * 512 / 10000))


def test_score_lands_on_eos_or_one_past_it():
    non_score = torch.full((3, 5), -0.1)
    scores = torch.tensor([1.0, 2.0, 3.0])
    lengths = torch.tensor([2, 5, 4])  # row 1 fills the width (no room past its end)
    rewards, value_mask = place_scores(non_score, scores, lengths, "eos")
    assert rewards[0].tolist() == pytest.approx([-0.1, 0.9, -0.1, -0.1, -0.1])
    assert rewards[1, 4].item() == pytest.approx(1.9) and rewards[2, 3].item() == pytest.approx(2.9)
    assert value_mask.tolist() == [[True, True, False, False, False], [True] * 5, [True, True, True, True, False]]
    rewards, value_mask = place_scores(non_score, scores, lengths, "after_eos")
    assert rewards[0].tolist() == pytest.approx([-0.1, -0.1, 0.9, -0.1, -0.1])
    assert rewards[1, 4].item() == pytest.approx(1.9) and rewards[2, 4].item() == pytest.approx(2.9)
    assert value_mask.tolist() == [[True, True, True, False, False], [True] * 5, [True] * 5]


def ppo(model_dir, prompts, out):
    return f"ppo.py --model_name_or_path {model_dir} --dataset_name {prompts} --output_dir {out}"


@pytest.mark.parametrize("script", ["ppo.py", "ppo_tldr.py"])
def test_rollout_values_do_not_depend_on_the_chunking(
    run, tmp_path, script, eos_model_dir, tiny_prompts_file, tldr_dir, tiny_reward_model_dir
):
    """With --score_position after_eos the score sits one past the stop token, whose value is the critic's at the stop
    token. A row that stops at its rollout chunk's last column must get that value too, as when the whole batch runs
    in one chunk: the critic over the padded batch, which is also what the update's first pass predicts."""
    (tmp_path / "reward.py").write_text(VOWELS)
    if script == "ppo.py":
        command = ppo(eos_model_dir, tiny_prompts_file, "{out}") + f" --reward_fn {tmp_path}/reward.py:vowels"
    else:  # the TL;DR setup: reward model, missing-EOS penalty; a greedy evaluation of 2 prompts
        command = (
            f"ppo_tldr.py --sft_model_path {eos_model_dir} --reward_model_path {tiny_reward_model_dir} --dataset_name"
            f" {tldr_dir} --max_prompt_length 200 --eval_every 0 --eval_examples 2 --eval_batch_size 2 --output_dir {{out}}"
        )
    command += (
        " --score_position after_eos --response_length 6 --temperature 1.0 --total_episodes 32"
        " --per_device_train_batch_size 8 --gradient_accumulation_steps 4 --num_mini_batches 1 --num_ppo_epochs 1"
        " --learning_rate 0.0 --num_sample_generations 0 --no_save_model"
        # a tight value clip range: a value the update predicts otherwise than the rollout would show as clipped
        " --cliprange_value 0.001 --local_rollout_forward_batch_size {chunk}"
    )
    rows = {}
    for chunk in (32, 2):  # one chunk; 16 chunks, most of them stopping before the batch's widest
        out = tmp_path / f"chunk{chunk}"
        check_ok(run(command.format(out=out, chunk=chunk), tmp_path))
        rows[chunk] = [r for r in read_metrics(out) if "objective/scores" in r]
    (whole,), (chunked,) = rows[32], rows[2]
    assert whole["val/num_eos_tokens"] >= 16 and whole["val/response_length"] < 5  # the model does stop early
    for key in ("objective/scores", "val/response_length", "val/vpred", "loss/value_avg"):  # the same completions
        assert chunked[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key
    # one epoch, one mini-batch: the update predicts the rollout's values, so none is clipped
    assert chunked["val/clipfrac_avg"] == whole["val/clipfrac_avg"] == 0.0


def test_score_rises_and_the_policy_and_critic_reload(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    (tmp_path / "reward.py").write_text(VOWELS)
    out = tmp_path / "out"
    proc = run(
        ppo(tiny_model_dir, tiny_prompts_file, out) + f" --reward_fn {tmp_path}/reward.py:vowels --total_episodes 1280"
        " --per_device_train_batch_size 64 --gradient_accumulation_steps 1 --response_length 16 --learning_rate 2e-2"
        " --kl_coef 0.01 --temperature 1.0 --num_sample_generations 0",
        cwd=tmp_path,
    )
    check_ok(proc)
    rows = read_metrics(out)
    for r in rows:
        assert sorted(r) == sorted(PPO_KEYS + reward_keys("vowels")) and all(math.isfinite(v) for v in r.values())
    scores = [r["objective/scores"] for r in rows]
    # from about 0.21: a rise of 0.08 to 0.14 over seeds 1 to 3 (a new critic head's draw moves it by a few hundredths)
    assert sum(scores[-5:]) / 5 > sum(scores[:5]) / 5 + 0.05, scores

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "gpt_neox"
    critic = AutoModelForSequenceClassification.from_pretrained(out / "critic")
    assert critic.config.num_labels == 1

    # continue training from the saved policy and critic; with a zero learning rate the critic must come back unchanged
    out2 = tmp_path / "out2"
    short = " --total_episodes 16 --per_device_train_batch_size 8 --learning_rate 0.0 --response_length 8"
    proc = run(ppo(out, tiny_prompts_file, out2) + f" --value_model_path {out / 'critic'}" + short, cwd=tmp_path)
    check_ok(proc)
    before, after = load_file(out / "critic" / "model.safetensors"), load_file(out2 / "critic" / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # and the critic really is the trained one, not a fresh head: its values differ from a new critic's
    fresh = tmp_path / "fresh"
    check_ok(run(ppo(out, tiny_prompts_file, fresh) + short, cwd=tmp_path))
    assert not torch.equal(load_file(fresh / "critic" / "model.safetensors")["score.weight"], after["score.weight"])


def test_variants_run_shared_head_kl_loss_adaptive(run, tmp_path, tiny_model_dir, tiny_reward_model_dir, tiny_prompts_file):
    common = (
        " --total_episodes 48 --per_device_train_batch_size 8 --gradient_accumulation_steps 1 --num_mini_batches 2"
        " --num_ppo_epochs 2 --response_length 8 --num_sample_generations 0"
    )
    out = tmp_path / "shared"
    variant = " --value_head_shared --kl_penalty loss --score_position after_eos --whiten_rewards"
    proc = run(ppo(tiny_model_dir, tiny_prompts_file, out) + common + variant, cwd=tmp_path)
    check_ok(proc)
    assert "kl_estimator='k2'" in proc.stdout  # the default in the loss (the printed config)
    assert os.path.exists(out / "value_head.safetensors") and not os.path.exists(out / "critic")
    assert all(r["objective/non_score_reward"] == 0.0 for r in read_metrics(out))  # the KL is in the loss, not the reward

    out = tmp_path / "adaptive"
    variant = f" --kl_target 0.001 --kl_horizon 100 --reward_model_path {tiny_reward_model_dir} --target_kl 1e-9"
    proc = run(ppo(tiny_model_dir, tiny_prompts_file, out) + common + variant, cwd=tmp_path)
    check_ok(proc)
    assert "kl_estimator='k1'" in proc.stdout  # the default in the reward
    rows = read_metrics(out)
    for prev, nxt in zip(rows, rows[1:]):
        expected = adaptive_kl_coef(prev["objective/kl_coef"], prev["objective/kl"], 0.001, 100, 16)
        assert nxt["objective/kl_coef"] == pytest.approx(expected)
    assert rows[0]["objective/kl_coef"] == 0.05
    card = (out / "README.md").read_text()  # the model card
    assert "- **Algorithm:** PPO (`ppo.py`)" in card and f"| reward model `{tiny_reward_model_dir}` | 1 |" in card


def test_target_kl_stops_the_remaining_epochs(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """--target_kl: once an epoch's approximate KL to the rollout policy passes it, the update runs no more epochs.
    With a target the first epoch always passes (its second mini-batch runs after a step), 4 epochs train exactly as
    1 does, row for row: any later epoch would change the statistics, the weights and so the next rollouts. With a
    target never passed, the 4 epochs run and the rows differ."""
    (tmp_path / "reward.py").write_text(VOWELS)
    common = (
        f" --reward_fn {tmp_path}/reward.py:vowels --total_episodes 32 --per_device_train_batch_size 4"
        " --gradient_accumulation_steps 1 --num_mini_batches 2 --response_length 8 --learning_rate 1e-3"
        " --num_sample_generations 0 --no_save_model"
    )
    runs = {
        "one": " --num_ppo_epochs 1",
        "stopped": " --num_ppo_epochs 4 --target_kl 1e-12",
        "all": " --num_ppo_epochs 4 --target_kl 1e6",
    }
    rows = {}
    for name, extra in runs.items():
        check_ok(run(ppo(tiny_model_dir, tiny_prompts_file, tmp_path / name) + common + extra, cwd=tmp_path))
        rows[name] = [{k: v for k, v in r.items() if k != "eps"} for r in read_metrics(tmp_path / name)]  # eps: timing
    assert len(rows["one"]) == 4
    assert rows["stopped"] == rows["one"]
    assert [r["policy/approxkl_avg"] for r in rows["all"]] != [r["policy/approxkl_avg"] for r in rows["one"]]


def test_bad_ppo_flags(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    proc = run(
        ppo(tiny_model_dir, tiny_prompts_file, tmp_path / "o") + f" --value_head_shared --value_model_path {tiny_model_dir}",
        cwd=tmp_path,
    )
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("script", ["ppo.py", "ppo_tldr.py"])
def test_kl_loss_refuses_k1_before_loading_anything(run, tmp_path, script):
    # the model path holds no model: the flags are refused before any model is looked for
    model_flag = "--model_name_or_path" if script == "ppo.py" else "--sft_model_path"
    (tmp_path / "empty").mkdir()
    command = f"{script} {model_flag} {tmp_path / 'empty'} --output_dir {tmp_path / 'out'} --kl_penalty loss"
    proc = run(command + " --kl_estimator k1", cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --kl_penalty loss needs --kl_estimator k2 or k3"), proc.stderr[-2000:]


def test_embedded_default_runs_offline(run, tmp_path):
    pytest.importorskip("gguf")
    out = tmp_path / "out"
    proc = run(
        f"ppo.py --total_episodes 4 --per_device_train_batch_size 2 --response_length 8 --output_dir {out}",
        cwd=tmp_path,
        timeout=900,
    )
    check_ok(proc)
    (row,) = read_metrics(out)
    assert sorted(row) == sorted(PPO_KEYS + reward_keys("sentiment")) and row["episode"] == 4
    assert os.path.exists(out / "critic" / "model.safetensors")
