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
