"""Checkpoints, exact resume after kill -9, non-finite guards: for rloo.py, ppo.py and grpo.py."""

import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, kill_after_rows
from test_rloo import VOWELS, check_ok, read_metrics

SCRIPTS = {
    "rloo.py": "--rloo_k 2",
    "ppo.py": "--kl_target 0.5 --kl_horizon 100",  # the adaptive coefficient is state that must survive a resume
    # unscaled advantages: with the non-finite test's huge scores a group's std would overflow and zero them
    "grpo.py": "--num_generations 2 --beta 0.05 --scale_rewards none",
}


def command(script, model, prompts, out, extra=""):
    epochs = "--num_iterations" if script == "grpo.py" else "--num_ppo_epochs"  # GRPO's name for the passes
    return (
        f"{script} {SCRIPTS[script]} --model_name_or_path {model} --dataset_name {prompts} --output_dir {out}"
        f" --total_episodes 160 --per_device_train_batch_size 8 --gradient_accumulation_steps 2 {epochs} 2"
        f" --num_mini_batches 1 --response_length 8 --num_sample_generations 0 --checkpoint_every 1 {extra}"
    )


def without_eps(rows):
    return [{k: v for k, v in r.items() if k != "eps"} for r in rows]


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_kill_then_resume_gives_the_uninterrupted_metrics(script, run, tmp_path, tiny_model_dir, tiny_prompts_file):
    extra = ""
    if script == "grpo.py":  # the sentiment of random text is 0 for every completion: GRPO would have nothing to learn
        (tmp_path / "reward.py").write_text(VOWELS)
        extra = f"--reward_fn {tmp_path}/reward.py:vowels --beta 0.04 --use_adaptive_entropy --entropy_target 100"
    if script in ("grpo.py", "rloo.py"):  # the reference moves with the policy (every third step): a checkpoint holds it
        extra += " --sync_ref_model --ref_model_sync_steps 3 --ref_model_mixup_alpha 0.5"
    extra += " --log_completions"
    full = tmp_path / "full"
    check_ok(run(command(script, tiny_model_dir, tiny_prompts_file, full, extra), cwd=tmp_path))
    expected = read_metrics(full)
    assert len(expected) == 10

    # the same run, killed with SIGKILL while it trains (possibly mid-checkpoint or mid-row), then resumed
    cut = tmp_path / "cut"
    first, *rest = shlex.split(command(script, tiny_model_dir, tiny_prompts_file, cut, extra))
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO, first), *rest], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    assert 4 <= kill_after_rows(proc, cut, 4) < 10

    check_ok(run(command(script, tiny_model_dir, tiny_prompts_file, cut, f"--resume {extra}"), cwd=tmp_path))
    resumed = read_metrics(cut)
    assert [r["episode"] for r in resumed] == [16 * i for i in range(1, 11)]  # no duplicate, no missing row
    assert without_eps(resumed) == without_eps(expected)
    # --log_completions: every completion once, as the uninterrupted run wrote it
    with open(full / "completions.jsonl") as f, open(cut / "completions.jsonl") as g:
        assert f.read() == g.read()

    from safetensors.torch import load_file

    a, b = load_file(full / "model.safetensors"), load_file(cut / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # only the newest two checkpoints are kept, complete, and their state loads without unpickling code
    names = sorted(n for n in os.listdir(cut) if n.startswith("checkpoint-"))
    assert names == ["checkpoint-0000009", "checkpoint-0000010"]
    state = torch.load(cut / names[-1] / "state.pt", weights_only=True)
    assert state["update"] == 10 and state["episode"] == 160


def test_resume_drops_torn_and_later_rows(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    out = tmp_path / "out"
    base = command("rloo.py", tiny_model_dir, tiny_prompts_file, out).replace("--total_episodes 160", "--total_episodes 48")
    check_ok(run(base + " --keep_checkpoints 5", cwd=tmp_path))
    rows = read_metrics(out)
    # pretend the run died after writing row 3 but before its checkpoint, in the middle of writing row 4
    shutil.rmtree(out / "checkpoint-0000003")
    os.remove(out / "model.safetensors")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"episode": 64, "eps": 1.')
    check_ok(run(base + " --resume", cwd=tmp_path))
    again = read_metrics(out)
    assert [r["episode"] for r in again] == [16, 32, 48]
    assert without_eps(again) == without_eps(rows)


def test_resume_continues_the_logs_and_refuses_changed_arguments(
    run, tmp_path, tiny_model_dir, tiny_prompts_file, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    out = tmp_path / "out"
    base = command("rloo.py", tiny_model_dir, tiny_prompts_file, out).replace("--total_episodes 160", "--total_episodes 48")
    base += " --keep_checkpoints 5 --track"
    check_ok(run(base, cwd=tmp_path))
    shutil.rmtree(out / "checkpoint-0000003")  # as if killed after logging update 3, before its checkpoint

    changed = base.replace("--per_device_train_batch_size 8", "--per_device_train_batch_size 4") + " --learning_rate 1e-3"
    proc = run(changed + " --resume", cwd=tmp_path)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and last.startswith("error: --resume with arguments that change the run:"), last
    assert "per_device_train_batch_size 8 -> 4" in last and "learning_rate 5e-05 -> 0.001" in last
    assert "batch_size 16 -> 8" in last  # derived sizes too (the process count among them)
    # flags that do not change the run may change
    check_ok(run(base + " --resume --num_sample_generations 1 --checkpoint_every 2", cwd=tmp_path))

    # TensorBoard under output_dir: the steps the killed run logged past its checkpoint were dropped, then logged anew
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "runs"))
    events.Reload()
    scores = events.Scalars("objective/scores")
    assert [e.step for e in scores] == [16, 32, 48]
    assert [e.value for e in scores] == pytest.approx([r["objective/scores"] for r in read_metrics(out)])
    assert not os.path.exists(tmp_path / "runs")  # nothing in the working directory
    # wandb: the resumed process logs to the same run
    run_id = (out / "wandb_id").read_text()
    starts = [n for n in os.listdir(tmp_path / "wandb") if n.startswith("offline-run-")]
    assert len(starts) == 2 and all(n.endswith(run_id) for n in starts), starts


def test_resume_needs_a_checkpoint(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    proc = run(command("rloo.py", tiny_model_dir, tiny_prompts_file, tmp_path / "none", "--resume"), cwd=tmp_path)
    assert proc.returncode != 0 and "no complete checkpoint" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_non_finite_gradient_stops_and_names_the_last_checkpoint(script, run, tmp_path, tiny_model_dir, tiny_prompts_file):
    # finite scores, but so large that the gradients overflow once the policy starts to move them
    (tmp_path / "huge.py").write_text(
        "import itertools\nn = itertools.count()\n"
        "def huge(prompts, completions):\n    return [3e38 * (next(n) % 2) for _ in completions]\n"
    )
    out = tmp_path / "out"
    proc = run(command(script, tiny_model_dir, tiny_prompts_file, out, f"--reward_fn {tmp_path}/huge.py:huge"), cwd=tmp_path)
    assert proc.returncode != 0, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr and last.startswith("error: non-finite") and "at update " in last, last
    # every checkpoint on disk holds finite weights
    from safetensors.torch import load_file

    for name in os.listdir(out):
        if name.startswith("checkpoint-"):
            weights = load_file(out / name / "model.safetensors")
            assert all(torch.isfinite(v).all() for v in weights.values())


def test_model_code_runs_only_with_trust_remote_code(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    import json

    model = tmp_path / "custom"
    shutil.copytree(tiny_model_dir, model)
    marker = tmp_path / "code_ran"
    (model / "modeling_custom.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import GPTNeoXForCausalLM\n\nclass CustomModel(GPTNeoXForCausalLM):\n    pass\n"
    )
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomModel"}
    (model / "config.json").write_text(json.dumps(config))
    # without the flag transformers falls back to its own GPT-NeoX class (or refuses): the shipped code never runs
    run(command("rloo.py", model, tiny_prompts_file, tmp_path / "out"), cwd=tmp_path)
    assert not marker.exists()
    check_ok(run(command("rloo.py", model, tiny_prompts_file, tmp_path / "out2", "--trust_remote_code"), cwd=tmp_path))
    assert marker.exists()
