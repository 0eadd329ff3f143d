"""Two processes on a CPU through accelerate: data sharded, metrics reduced and written once, episodes counted over
both, the model saved once."""

import os
import shlex
import subprocess
import sys

import pytest
from test_rloo import check_ok, read_metrics


@pytest.mark.parametrize("script", ["rloo.py", "ppo.py"])
def test_two_processes(script, tmp_path, tiny_model_dir, tiny_prompts_file):
    from conftest import REPO

    out = tmp_path / "out"
    args = (
        f"--model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --output_dir {out} --total_episodes 64"
        " --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --response_length 8 --num_sample_generations 0"
    )
    # accelerate's own launcher (torchrun underneath) with the processes told to use the CPU
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no", os.path.join(REPO, script), *shlex.split(args)]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    check_ok(proc)
    assert "world_size=2" in proc.stdout
    rows = read_metrics(out)
    # 64 episodes in updates of 2 processes x 4 x 2 completions, each row written once
    assert [r["episode"] for r in rows] == [16, 32, 48, 64]
    assert os.path.exists(out / "model.safetensors")


@pytest.mark.parametrize("name", ["single_gpu", "multi_gpu", "deepspeed_zero2"])
def test_accelerate_configs_load_and_leave_accumulation_to_the_scripts(name):
    from accelerate.commands.config.config_args import load_config_from_file
    from conftest import REPO

    config = load_config_from_file(os.path.join(REPO, "configs", f"{name}.yaml"))
    assert str(config.distributed_type).endswith({"single_gpu": "NO", "multi_gpu": "MULTI_GPU"}.get(name, "DEEPSPEED"))
    assert config.num_processes == (1 if name == "single_gpu" else 8)
    assert "gradient_accumulation_steps" not in (config.deepspeed_config or {})
    assert "gradient_clipping" not in (config.deepspeed_config or {})


def test_accumulation_set_by_an_accelerate_config_is_refused(run, tmp_path, tiny_model_dir, tiny_prompts_file, monkeypatch):
    # what `accelerate launch` exports when its config names gradient_accumulation_steps
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    proc = run(f"rloo.py --model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file}", tmp_path)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: the accelerate config sets gradient_accumulation_steps=4")


@pytest.mark.parametrize("script", ["rloo.py", "ppo_tldr.py"])
def test_deepspeed_zero2_matches_a_plain_run(
    script, run, tmp_path, tiny_model_dir, tiny_reward_model_dir, tiny_prompts_file, tldr_dir
):
    """configs/deepspeed_zero2.yaml with one CPU process: DeepSpeed's engine and ZeRO-2 optimiser take the same steps
    as plain PyTorch (fp32 throughout), so the metrics and the saved model agree."""
    import torch
    from conftest import REPO
    from safetensors.torch import load_file
    from test_tldr import small

    if script == "rloo.py":
        args = (
            f"--model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --total_episodes 48 --rloo_k 4"
            " --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --num_mini_batches 2 --response_length 8"
            " --num_sample_generations 0 --learning_rate 1e-3"
        )
    else:
        args = small("ppo_tldr.py", tldr_dir, tiny_model_dir, tiny_reward_model_dir, "unused").split(" --output_dir")[0]
        args = args.split(" ", 1)[1] + " --learning_rate 1e-3"
    config = tmp_path / "zero2.yaml"
    with open(os.path.join(REPO, "configs", "deepspeed_zero2.yaml")) as f:
        config.write_text(f.read().replace("num_processes: 8", "num_processes: 1"))
    proc = run(f"{script} {args} --output_dir {tmp_path / 'plain'}", tmp_path)
    check_ok(proc)
    assert "distributed_type='NO'" in proc.stdout
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), os.path.join(REPO, script)]
    cmd += [*shlex.split(args), "--output_dir", str(tmp_path / "ds")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=os.environ.copy(), timeout=600)
    check_ok(proc)
    assert "distributed_type='DEEPSPEED'" in proc.stdout

    plain, ds = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "ds")
    assert len(plain) == len(ds) >= 3
    for a, b in zip(plain, ds):
        assert a.keys() == b.keys()
        for k in a:
            if k != "eps":
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    a, b = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "ds" / "model.safetensors")
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], load_file(os.path.join(tiny_model_dir, "model.safetensors"))[k]) for k in a)  # trained
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
