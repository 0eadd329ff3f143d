"""TRL's score scaling and clipping, ratio threshold and variable response lengths (issue 18, items 1, 3 and 4): the
running moments and the transform against naive recomputations, then each flag run as a user would."""

import json
import os
import shutil
import statistics
import sys

import pytest
import torch
from conftest import REPO
from test_reliability import without_eps
from test_rloo import VOWELS, check_ok, read_metrics

sys.path.insert(0, REPO)
import utils  # noqa: E402

EPS = torch.finfo(torch.float32).eps


def batches():
    """Score batches of several sizes, with unscored rows (their scores as weighted_scores leaves them: 0)."""
    g = torch.Generator().manual_seed(0)
    for size, shift in [(7, 3.0), (12, -1.0), (5, 10.0), (9, 0.5)]:
        scores = torch.randn(size, generator=g) * 2 + shift
        scored = torch.rand(size, generator=g) > 0.3
        scored[0] = True
        yield scores.masked_fill(~scored, 0.0), scored
    yield torch.zeros(4), torch.zeros(4, dtype=torch.bool)  # nothing scored: the moments stay as they were


def test_running_moments_match_every_scored_value_so_far():
    moments, seen = utils.ScoreScaler(scaling=True), []
    for scores, scored in batches():
        moments.update(scores, scored)
        seen += scores[scored].tolist()
        assert moments.count == len(seen)
        assert moments.mean == pytest.approx(statistics.fmean(seen), rel=1e-6)
        assert moments.std() == pytest.approx(statistics.stdev(seen), rel=1e-5)


def test_running_moments_of_two_processes_equal_one():
    """Each process holds half of every batch; `reduce` adds the other half's sums, as accelerator.reduce would."""
    one, two, seen = utils.ScoreScaler(scaling=True), [utils.ScoreScaler(scaling=True), utils.ScoreScaler(scaling=True)], []
    for scores, scored in batches():
        one.update(scores, scored)
        half = len(scores) // 2
        parts = [(scores[:half], scored[:half]), (scores[half:], scored[half:])]
        batch_mean = scores[scored].mean() if scored.any() else torch.tensor(0.0)
        for p in range(2):
            other, other_scored = parts[1 - p]
            calls = iter(range(2))

            def reduce(t, other=other, m=other_scored.float()):
                if next(calls) == 0:
                    return t + torch.stack([(other * m).sum(), m.sum()])
                return t + ((other - batch_mean) ** 2 * m).sum()

            two[p].reduce = reduce
            two[p].update(*parts[p])
        seen += scores[scored].tolist()
        for moments in two:
            assert moments.count == one.count == len(seen)
            assert moments.mean == pytest.approx(one.mean, rel=1e-6)
            assert moments.m2 == pytest.approx(one.m2, rel=1e-5)


CASES = [(True, False, None), (True, True, None), (True, True, 0.8), (False, False, 1.0)]  # (scaling, norm, clip)


@pytest.mark.parametrize("scaling, norm, clip", CASES)
def test_scale_scores_matches_a_loop_and_leaves_unscored_rows_alone(scaling, norm, clip):
    """The batch joins the running moments first (with scaling), then is scaled by them."""
    moments = utils.ScoreScaler(scaling=scaling, norm=norm, clip=clip)
    for scores, scored in list(batches())[:2]:
        moments.update(scores, scored)
    scores, scored = next(batches())
    scores = scores.masked_fill(~scored, 7.0)  # an unscored row keeps whatever it holds
    count = moments.count
    out = moments(scores, scored)
    assert moments.count == count + scaling * scored.sum().item()
    std = moments.std()
    for s, ok, o in zip(scores.tolist(), scored.tolist(), out.tolist()):
        expected = s
        if ok:
            if scaling:
                expected = ((s - moments.mean) if norm else s) / (std + EPS)
            if clip is not None:
                expected = min(max(expected, -clip), clip)
        assert o == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert (out[~scored] == 7.0).all()


def base(script, model, prompts, out, tmp_path, extra=""):
    """a few tiny updates of script on the vowels reward, which a random model's text scores unevenly"""
    (tmp_path / "reward.py").write_text(VOWELS)
    k = {"rloo.py": "--rloo_k 2", "grpo.py": "--num_generations 2", "ppo.py": ""}[script]
    return (
        f"{script} {k} --model_name_or_path {model} --dataset_name {prompts} --output_dir {out}"
        f" --reward_fn {tmp_path}/reward.py:vowels --num_sample_generations 0 --response_length 6 {extra}"
    )


def test_score_scaling_uses_running_moments_and_resumes_exactly(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """Two updates of RLOO with score norm, clip, the missing-EOS penalty and drawn lengths; the advantages' scores are
    the raw ones normalised by the moments of every score so far; a run resumed from the first checkpoint (a copy of
    the run cut back to it) writes the same rows, so the moments (and the length draw) came back."""
    full = tmp_path / "full"
    flags = (
        "--total_episodes 32 --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --checkpoint_every 1"
        " --use_score_scaling --use_score_norm --score_clip 1.5 --missing_eos_penalty 0.1 --response_length_min 3"
        " --log_completions"
    )
    command = base("rloo.py", tiny_model_dir, tiny_prompts_file, full, tmp_path, flags)
    check_ok(run(command, cwd=tmp_path))
    rows = read_metrics(full)
    assert len(rows) == 2
    with open(full / "completions.jsonl") as f:
        completions = [json.loads(line) for line in f]
    seen = []
    for row in rows:
        raw = [c["score"] for c in completions if c["episode"] == row["episode"]]
        seen += raw
        # the moments took this update's scores in before they scaled them (TRL's order)
        mean, std = statistics.fmean(seen), statistics.stdev(seen)
        assert row["objective/score_mean_running"] == pytest.approx(mean, rel=1e-5)
        assert row["objective/score_std_running"] == pytest.approx(std, rel=1e-4)
        assert row["objective/scores"] == pytest.approx(statistics.fmean(raw), rel=1e-5)  # the raw score, logged
        scaled = [min(max((s - mean) / (std + EPS), -1.5), 1.5) for s in raw]
        # RLOO's rlhf_reward is the score the advantages see plus the KL penalty
        used = row["objective/rlhf_reward"] - row["objective/non_score_reward"]
        assert used == pytest.approx(statistics.fmean(scaled), rel=1e-4, abs=1e-5)
        assert 3 <= row["completions/max_length_allowed"] <= 6
    assert not any(k.startswith("policy/skipped") for k in rows[0])  # off by default
    # the moments, among the objects accelerate's checkpoint holds
    saved = [torch.load(f, weights_only=False) for f in (full / "checkpoint-0000001").glob("custom_checkpoint_*.pkl")]
    assert [s["count"] for s in saved if isinstance(s, dict) and "m2" in s] == [16]

    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoint-0000002")
    check_ok(run(command.replace(f"--output_dir {full}", f"--output_dir {cut}") + " --resume", cwd=tmp_path))
    assert without_eps(read_metrics(cut)) == without_eps(rows)


@pytest.mark.parametrize("script", ["rloo.py", "ppo.py", "grpo.py"])
def test_ratio_threshold_below_one_and_drawn_lengths(script, run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """One run for two flags. --ratio_threshold 0.5: ratios start at 1 (the rollout's policy), above it, so every
    micro-batch is skipped, no step ever has a gradient and the policy saved is the initial one (AdamW's steps on zero
    gradients from a zero state move nothing). --response_length_min 2: each update's drawn length lies in [2, 6], and
    without a stop token every completion is as long as allowed, so the mean length is the drawn one, exactly."""
    out = tmp_path / "out"
    flags = (
        "--total_episodes 16 --per_device_train_batch_size 2 --gradient_accumulation_steps 2 --learning_rate 1e-2"
        " --ratio_threshold 0.5 --response_length_min 2 --stop_token None"
    )
    check_ok(run(base(script, tiny_model_dir, tiny_prompts_file, out, tmp_path, flags), cwd=tmp_path))
    rows = read_metrics(out)
    assert len(rows) == 4 and all(r["policy/skipped_ratio_threshold"] == 1.0 for r in rows)
    from safetensors.torch import load_file

    before, after = load_file(os.path.join(tiny_model_dir, "model.safetensors")), load_file(out / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

    drawn = [r["completions/max_length_allowed"] for r in rows]
    assert all(2 <= n <= 6 for n in drawn) and len(set(drawn)) > 1, drawn
    # drawn from the generator the processes share, after each update's prompts and sampling noise
    g = torch.Generator().manual_seed(1)
    torch.randperm(64, generator=g)  # the prompt order (8 of the 64 prompts are used: no reshuffle)
    expected = []
    for _ in rows:
        torch.rand(4 * 6, generator=g)  # the sampling noise: 4 completions x 6 positions
        expected.append(torch.randint(2, 7, (), generator=g).item())
    assert drawn == expected
    length = "completions/mean_length" if script == "grpo.py" else "val/response_length"
    assert [r[length] for r in rows] == drawn
    assert not any(k.startswith("objective/score_") for k in rows[0])  # off by default


def test_ratio_threshold_skips_only_runaway_micro_batches(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """A big learning rate over 4 epochs of 2 mini-batches drives the ratio past 1.02 after the first steps, which ran:
    some micro-batches are skipped, not all."""
    out = tmp_path / "out"
    flags = (
        "--total_episodes 8 --per_device_train_batch_size 4 --gradient_accumulation_steps 1 --num_mini_batches 2"
        " --num_ppo_epochs 4 --learning_rate 3e-2 --ratio_threshold 1.02"
    )
    check_ok(run(base("rloo.py", tiny_model_dir, tiny_prompts_file, out, tmp_path, flags), cwd=tmp_path))
    (row,) = read_metrics(out)
    assert 0 < row["policy/skipped_ratio_threshold"] < 1, row


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--response_length_min 0", "--response_length_min must be in [1, --response_length 6], got 0"),
        ("--response_length_min 7", "--response_length_min must be in [1, --response_length 6], got 7"),
        ("--use_score_norm", "--use_score_norm needs --use_score_scaling"),
    ],
)
def test_bad_flags_are_one_line_before_any_model_loads(flags, message, run, tmp_path, tiny_prompts_file):
    # a folder without a model: the flags must be refused before anything reaches for it
    (tmp_path / "no_model").mkdir()
    proc = run(base("rloo.py", tmp_path / "no_model", tiny_prompts_file, tmp_path / "out", tmp_path, flags), cwd=tmp_path)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert last.startswith(f"error: {message}"), last
