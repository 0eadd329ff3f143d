"""Two processes on a CPU through accelerate: data sharded, metrics reduced and written once, episodes counted over
both, the model saved once."""

import os
import shlex
import subprocess
import sys

import pytest
from test_rloo import VOWELS, check_ok, read_metrics


def launch(processes, script, args, cwd, config=None):
    """accelerate's own launcher (torchrun underneath); with processes > 1 and no config, the processes use the CPU."""
    from conftest import REPO

    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if config:
        cmd += ["--config_file", str(config)]
    else:
        cmd += ["--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        cmd += ["--multi_gpu"] if processes > 1 else []
    cmd += [os.path.join(REPO, script), *shlex.split(args)]
    env = {**os.environ} if config else {**os.environ, "ACCELERATE_USE_CPU": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


@pytest.mark.parametrize("script", ["rloo.py", "ppo.py"])
def test_two_processes(script, tmp_path, tiny_model_dir, tiny_prompts_file):
    out = tmp_path / "out"
    args = (
        f"--model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --output_dir {out} --total_episodes 64"
        " --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --response_length 8 --num_sample_generations 0"
    )
    proc = launch(2, script, args, tmp_path)
    check_ok(proc)
    assert "world_size=2" in proc.stdout
    rows = read_metrics(out)
    # 64 episodes in updates of 2 processes x 4 x 2 completions, each row written once
    assert [r["episode"] for r in rows] == [16, 32, 48, 64]
    assert os.path.exists(out / "model.safetensors")


@pytest.mark.parametrize("name", ["single_gpu", "multi_gpu", "deepspeed_zero2", "deepspeed_zero3"])
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


@pytest.mark.parametrize(
    "stage, script", [("zero2", "rloo.py"), ("zero2", "ppo_tldr.py"), ("zero3", "rloo_tldr.py"), ("zero3", "ppo_tldr.py")]
)
def test_deepspeed_matches_a_plain_run(
    stage, script, run, tmp_path, tiny_model_dir, tiny_reward_model_dir, tiny_prompts_file, tldr_dir
):
    """configs/deepspeed_zero{2,3}.yaml with one CPU process: DeepSpeed's engine and ZeRO optimiser take the same steps
    as plain PyTorch (fp32 throughout), so the metrics and the saved model agree. Under ZeRO-3 the weights are sharded
    from the moment they load, and the reference and reward models are inference engines."""
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
        args = small(script, tldr_dir, tiny_model_dir, tiny_reward_model_dir, "unused").split(" --output_dir")[0]
        args = args.split(" ", 1)[1] + " --learning_rate 1e-3"
    config = tmp_path / f"{stage}.yaml"
    with open(os.path.join(REPO, "configs", f"deepspeed_{stage}.yaml")) as f:
        config.write_text(f.read().replace("num_processes: 8", "num_processes: 1"))
    proc = run(f"{script} {args} --output_dir {tmp_path / 'plain'}", tmp_path)
    check_ok(proc)
    assert "distributed_type='NO'" in proc.stdout
    proc = launch(1, script, f"{args} --output_dir {tmp_path / 'ds'}", tmp_path, config=config)
    check_ok(proc)
    assert "distributed_type='DEEPSPEED'" in proc.stdout

    plain, ds = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "ds")
    assert len(plain) == len(ds) >= 3
    for a, b in zip(plain, ds):
        assert a.keys() == b.keys()
        for k in a:
            if "clipfrac" in k:  # counts of values past a threshold: a rounding difference can move one of them
                assert b[k] == pytest.approx(a[k], abs=0.02), k
            elif k != "eps":
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    a, b = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "ds" / "model.safetensors")
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], load_file(os.path.join(tiny_model_dir, "model.safetensors"))[k]) for k in a)  # trained
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


# metrics that do not depend on how the batch is split into micro-batches and processes
SAME = {
    "rloo.py": "objective/scores objective/kl objective/entropy objective/rlhf_reward loss/policy_avg val/num_eos_tokens",
    "ppo.py": "objective/scores objective/kl objective/entropy objective/rlhf_reward val/vpred loss/value_avg",
}


@pytest.mark.parametrize("script", ["rloo.py", "ppo.py"])
def test_two_processes_match_one_with_the_same_global_batch(script, tmp_path, tiny_model_dir, tiny_prompts_file):
    """Two processes x 2 micro-batches against one process x 4: the same 16 completions per update (the sampling
    noise is drawn for the global batch), the same averaged gradient, so the same rollouts at every later update."""
    (tmp_path / "reward.py").write_text(VOWELS)
    args = (
        f"--model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --reward_fn {tmp_path}/reward.py:vowels"
        " --total_episodes 48 --per_device_train_batch_size 4 --response_length 8 --temperature 1.0 --learning_rate 1e-3"
        " --num_sample_generations 0 --no_save_model"
    )
    if script == "ppo.py":
        args += " --stop_token None"  # equal lengths: the per-token loss means then do not depend on the split either
    check_ok(launch(1, script, f"{args} --gradient_accumulation_steps 4 --output_dir {tmp_path / 'one'}", tmp_path))
    check_ok(launch(2, script, f"{args} --gradient_accumulation_steps 2 --output_dir {tmp_path / 'two'}", tmp_path))
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["episode"] for r in one] == [r["episode"] for r in two] == [16, 32, 48]
    for a, b in zip(one, two):
        for key in SAME[script].split():
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), (key, a["episode"])
    assert one[0]["objective/scores"] != one[-1]["objective/scores"]  # the policy moved: later rollouts test the update


def test_bf16_rollout_policy_and_reference_agree(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """--bf16: the reference and reward models run under the same autocast as the policy, so the first update's KL is
    exactly zero (same weights, same precision), while the numbers differ from an fp32 run's."""
    args = (
        f"--model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --total_episodes 16 --rloo_k 4"
        " --per_device_train_batch_size 8 --response_length 8 --num_sample_generations 0 --no_save_model"
    )
    check_ok(run(f"rloo.py {args} --output_dir {tmp_path / 'fp32'}", tmp_path))
    check_ok(run(f"rloo.py {args} --bf16 --output_dir {tmp_path / 'bf16'}", tmp_path))
    fp32, bf16 = read_metrics(tmp_path / "fp32")[0], read_metrics(tmp_path / "bf16")[0]
    assert bf16["objective/kl"] == 0.0
    assert bf16["objective/entropy"] != fp32["objective/entropy"]
    assert bf16["objective/entropy"] == pytest.approx(fp32["objective/entropy"], rel=0.05)


@pytest.mark.parametrize("script", ["rloo.py", "ppo.py"])
def test_gradient_checkpointing_changes_only_memory(script, run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """The same run with and without --gradient_checkpointing, on a model with dropout in its config: checkpointing
    needs train mode, and with every dropout zeroed that computes what eval mode does. For rloo.py this also compares
    micro-batches that run each prompt once (plain) with micro-batches run row by row in full (checkpointing)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attention_dropout=0.3, hidden_dropout=0.3)
    model.save_pretrained(tmp_path / "dropout_model")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "dropout_model")
    args = (
        f"--model_name_or_path {tmp_path / 'dropout_model'} --dataset_name {tiny_prompts_file} --total_episodes 32"
        " --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --response_length 8 --learning_rate 1e-3"
        " --num_sample_generations 0 --no_save_model"
    )
    check_ok(run(f"{script} {args} --output_dir {tmp_path / 'plain'}", tmp_path))
    check_ok(run(f"{script} {args} --gradient_checkpointing --output_dir {tmp_path / 'ckpt'}", tmp_path))
    plain, ckpt = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "ckpt")
    assert len(plain) == len(ckpt) == 4
    for a, b in zip(plain, ckpt):
        for key in a:
            if key != "eps":
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
