"""Two processes on a CPU through accelerate: data sharded, metrics reduced and written once, episodes counted over
both, the model saved once."""

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch
from conftest import kill_after_rows
from safetensors.torch import load_file
from test_rloo import VOWELS, check_ok, read_metrics


def launch(processes, script, args, cwd, config=None, wait=True):
    """accelerate's own launcher (torchrun underneath); with no config, the processes use the CPU (ACCELERATE_USE_CPU,
    as the README's two-process command). wait=False returns the Popen, in a session of its own so that a test can
    kill the launcher and its processes together."""
    from conftest import REPO

    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if config:
        cmd += ["--config_file", str(config)]
    else:
        cmd += ["--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        cmd += ["--multi_gpu"] if processes > 1 else []
    cmd += [os.path.join(REPO, script), *shlex.split(args)]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # (a process that aborts prints its threads' Python stacks)
    env |= {} if config else {"ACCELERATE_USE_CPU": "1"}
    if not wait:
        out = subprocess.DEVNULL
        return subprocess.Popen(cmd, stdout=out, stderr=out, cwd=cwd, env=env, start_new_session=True)
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def shipped_config(name, processes, folder):
    """configs/{name}.yaml as shipped, with num_processes set as a user would set it to their GPU count; None (the
    CPU launcher above) for plain data parallelism, whose shipped config is for GPUs."""
    from conftest import REPO

    if name == "plain":
        return None
    with open(os.path.join(REPO, "configs", f"deepspeed_{name}.yaml")) as f:
        text = f.read()
    assert "num_processes: 8" in text
    path = folder / f"{name}.yaml"
    path.write_text(text.replace("num_processes: 8", f"num_processes: {processes}"))
    return path


@pytest.fixture(scope="session")
def runs(tmp_path_factory, eos_model_dir, tiny_reward_model_dir, tiny_prompts_file, tldr_dir):
    """The arguments of small runs of rloo.py, ppo.py, rloo_tldr.py, grpo.py and raft.py: 16 completions per update, split over
    gradient accumulation and processes by the caller; one mini-batch, so that the split does not change the steps.
    The policy stops at its EOS token at different steps, so processes finish generating at different steps too."""
    folder = tmp_path_factory.mktemp("runs")
    (folder / "reward.py").write_text(VOWELS)
    common = (
        " --per_device_train_batch_size 4 --response_length 8 --temperature 1.0 --learning_rate 1e-3"
        " --num_sample_generations 0"
    )
    # rloo.py, raft.py and ppo.py evaluate on the training prompts as if held out (greedy and 2 samples each, every 32
    # episodes): the same evaluation on any number of processes and in a resumed run
    held_out = f" --eval_dataset_name {tiny_prompts_file} --eval_every 32 --num_eval_generations 2 --eval_batch_size 16"
    return {
        # the advantages' normalisation is the global batch's
        "rloo.py": f"--model_name_or_path {eos_model_dir} --dataset_name {tiny_prompts_file} --rloo_k 4"
        f" --reward_fn {folder}/reward.py:vowels --total_episodes 48 --num_ppo_epochs 2 --normalize_advantage"
        + common
        + held_out,
        # the batch's std and DAPO's token count (the default loss) are the global batch's: summed over processes
        "grpo.py": f"--model_name_or_path {eos_model_dir} --dataset_name {tiny_prompts_file} --num_generations 4"
        f" --reward_fn {folder}/reward.py:vowels --total_episodes 48 --num_iterations 2 --beta 0.1"
        " --scale_rewards batch --mask_truncated_completions" + common,
        # each prompt's best completion kept, its tokens' mean NLL over the global batch's kept tokens
        "raft.py": f"--model_name_or_path {eos_model_dir} --dataset_name {tiny_prompts_file} --num_generations 4"
        f" --reward_fn {folder}/reward.py:vowels --total_episodes 48 --num_epochs 2" + common + held_out,
        # PPO's per-token means depend on how tokens fall into micro-batches unless every completion is as long
        "ppo.py": f"--model_name_or_path {eos_model_dir} --dataset_name {tiny_prompts_file} --stop_token None"
        f" --reward_fn {folder}/reward.py:vowels --total_episodes 48 --num_ppo_epochs 2" + common + held_out,
        # 9 evaluation prompts: the processes get 5 and 4, in 2 and 1 batches of 4
        "rloo_tldr.py": f"--sft_model_path {eos_model_dir} --reward_model_path {tiny_reward_model_dir}"
        f" --dataset_name {tldr_dir} --max_prompt_length 200 --total_episodes 32 --local_rollout_forward_batch_size 8"
        " --num_mini_batches 1 --eval_examples 9 --eval_batch_size 4 --normalize_advantage" + common,
    }


@pytest.fixture(scope="session")
def one_process(runs, tmp_path_factory):
    """The one-process run of each script, with the global batch of two processes x 2 micro-batches (run once)."""
    done = {}

    def get(script):
        if script not in done:
            out = tmp_path_factory.mktemp("one") / "out"
            check_ok(launch(1, script, f"{runs[script]} --gradient_accumulation_steps 4 --output_dir {out}", out.parent))
            done[script] = out
        return done[script]

    return get


# metrics that do not depend on how the batch is split into micro-batches and processes
SAME = {
    "rloo.py": "objective/scores objective/kl objective/entropy objective/rlhf_reward loss/policy_avg val/num_eos_tokens"
    " val/response_length eval/scores eval/mean@2 eval/pass@2 eval/response_length",
    "ppo.py": "objective/scores objective/kl objective/entropy objective/rlhf_reward val/vpred loss/value_avg"
    " eval/scores eval/mean@2 eval/pass@2 eval/response_length",
    "rloo_tldr.py": "objective/scores objective/kl objective/entropy objective/rlhf_reward loss/policy_avg"
    " val/num_eos_tokens val/response_length eval/scores eval/response_length eval/stopped_fraction",
    "raft.py": "objective/scores loss/sft raft/kept_score raft/kept_fraction val/response_length val/num_eos_tokens",
    "grpo.py": "reward reward_std frac_reward_zero_std objective/kl objective/entropy loss/policy_avg kl entropy"
    " policy/approxkl_avg completions/mean_length completions/min_length completions/max_length val/num_eos_tokens",
}


def assert_same_run(one, two, script):
    """Two runs' metrics rows agree on what does not depend on the split (up to float rounding), and they
    saved the same model."""
    rows_one, rows_two = read_metrics(one), read_metrics(two)
    assert [r["episode"] for r in rows_one] == [r["episode"] for r in rows_two]
    for a, b in zip(rows_one, rows_two):
        assert a.keys() == b.keys()
        for key in SAME[script].split():
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), (key, a["episode"])
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    for key in b.keys() - a.keys():  # DeepSpeed's state dict is cloned, so a tied output projection is written too
        assert key == "lm_head.weight" and torch.equal(b[key], b["model.embed_tokens.weight"])
    assert a.keys() <= b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-5)


# (each config once; ZeRO-3 with PPO's critic; raft.py, whose kept statistics are the global batch's)
KILLED = {("rloo.py", "plain"), ("rloo.py", "zero2"), ("ppo.py", "zero3"), ("raft.py", "plain")}


@pytest.mark.parametrize(
    "script, config",
    [(s, c) for s in ["rloo.py", "ppo.py"] for c in ["plain", "zero2", "zero3"]]
    # (the others share rloo.py's and ppo.py's plumbing)
    + [("grpo.py", "plain"), ("raft.py", "plain"), ("rloo_tldr.py", "zero3")],
)
def test_two_processes_match_one(script, config, tmp_path, runs, one_process):
    """Two processes x 2 micro-batches against one process x 4, under each shipped way to run several processes
    (plain data parallelism, ZeRO-2, ZeRO-3): the same completions each update (the sampling noise is drawn for the
    global batch), the same averaged gradient, so the same metrics at every later update and the same saved model.
    Under ZeRO-3 every forward pass gathers weights from both processes: the test also shows that neither waits
    forever for the other. Once under each config (KILLED), the two processes are killed with SIGKILL with their
    launcher while they train (possibly mid-checkpoint) and resumed: under DeepSpeed each process writes and reads its
    own shard of the ZeRO state (optimiser, and under ZeRO-3 the weights)."""
    two = tmp_path / "two"
    config_path = shipped_config(config, 2, tmp_path)
    command = f"{runs[script]} --gradient_accumulation_steps 2 --output_dir {two}"
    if (script, config) in KILLED:
        command += " --checkpoint_every 1"
        proc = launch(2, script, command, tmp_path, config_path, wait=False)
        # the rows: the evaluation before training, updates 1 and 2 (checkpoint 1 complete), then 3 more to come
        assert 3 <= kill_after_rows(proc, two, 3, group=True) < 6
        command += " --resume"
    proc = launch(2, script, command, tmp_path, config_path)
    check_ok(proc)
    assert "world_size=2" in proc.stdout
    assert f"distributed_type='{'MULTI_CPU' if config == 'plain' else 'DEEPSPEED'}'" in proc.stdout
    one = one_process(script)
    assert_same_run(one, two, script)
    train = [r for r in read_metrics(one) if "objective/scores" in r]
    assert len(train) >= 2 and train[0]["objective/scores"] != train[-1]["objective/scores"]  # later rollouts moved
    if script in ("rloo.py", "grpo.py"):  # completions stop at different steps
        assert 0 < train[0]["val/num_eos_tokens"] < 16
    if (script, config) in KILLED and config != "plain":  # (accelerate's folder name)
        shards = os.listdir(two / "checkpoint-0000003" / "pytorch_model")
        assert len([n for n in shards if "optim_states" in n]) == 2  # one per process


def test_ppo_tldr_under_deepspeed_takes_the_steps_of_plain_data_parallelism(
    tmp_path, tiny_model_dir, tiny_reward_model_dir, tldr_dir
):
    """ppo_tldr.py (the critic starts from the reward model, the score one past EOS, several epochs and mini-batches)
    with 2 processes under each DeepSpeed config against 2 plain processes: the same split, so every metric agrees,
    the evaluation and the saved policy too."""
    from test_tldr import small

    args = small("ppo_tldr.py", tldr_dir, tiny_model_dir, tiny_reward_model_dir, "{out}", "--learning_rate 1e-3")
    args = args.split(" ", 1)[1].replace("--total_episodes 32", "--total_episodes 64")
    runs = {}
    for config in ["plain", "zero2", "zero3"]:
        runs[config] = tmp_path / config
        proc = launch(2, "ppo_tldr.py", args.format(out=runs[config]), tmp_path, shipped_config(config, 2, tmp_path))
        check_ok(proc)
    plain = read_metrics(runs["plain"])
    assert len(plain) == 4  # 2 updates, 2 evaluations
    trained = load_file(runs["plain"] / "model.safetensors")
    assert any(not torch.equal(v, load_file(os.path.join(tiny_model_dir, "model.safetensors"))[k]) for k, v in trained.items())
    for config in ["zero2", "zero3"]:
        rows = read_metrics(runs[config])
        assert [r.keys() for r in rows] == [r.keys() for r in plain]
        for a, b in zip(plain, rows):
            for k in a:
                if "clipfrac" in k:  # counts of values past a threshold: a rounding difference can move one of them
                    assert b[k] == pytest.approx(a[k], abs=0.05), (config, k)
                elif k != "eps":
                    assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-5), (config, k, a["episode"])
        a, b = load_file(runs["plain"] / "model.safetensors"), load_file(runs[config] / "model.safetensors")
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-5)


def test_zero3_generation_waits_for_every_process(tmp_path, runs, one_process):
    """ZeRO-3 with every layer's weights gathered anew at each forward pass, as for a model too large for DeepSpeed to
    keep them (stage3_max_reuse_distance 0): a process whose completions have all stopped must keep stepping until
    the other's have, or the two processes' gathers no longer pair up."""
    (tmp_path / "ds.json").write_text(
        json.dumps(
            {
                "train_batch_size": "auto",
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "zero_optimization": {
                    "stage": 3,
                    "stage3_max_live_parameters": 0,
                    "stage3_max_reuse_distance": 0,
                    "stage3_prefetch_bucket_size": 0,
                    "stage3_param_persistence_threshold": 0,
                    "stage3_gather_16bit_weights_on_model_save": True,
                },
            }
        )
    )
    (tmp_path / "ds.yaml").write_text(
        f"compute_environment: LOCAL_MACHINE\ndeepspeed_config:\n  deepspeed_config_file: {tmp_path / 'ds.json'}\n"
        "  zero3_init_flag: false\ndistributed_type: DEEPSPEED\nmachine_rank: 0\nnum_machines: 1\nnum_processes: 2\n"
        "rdzv_backend: static\nsame_network: true\nuse_cpu: false\n"
    )
    two = tmp_path / "two"
    check_ok(
        launch(
            2,
            "rloo.py",
            f"{runs['rloo.py']} --gradient_accumulation_steps 2 --output_dir {two}",
            tmp_path,
            tmp_path / "ds.yaml",
        )
    )
    assert_same_run(one_process("rloo.py"), two, "rloo.py")


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


@pytest.mark.parametrize("script", ["rloo.py", "ppo.py"])  # grpo.py: the same copied lines as rloo.py
def test_gradient_checkpointing_changes_only_memory(script, run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """The same run with and without --gradient_checkpointing, on a model with dropout in its config: checkpointing
    needs train mode, and with every dropout zeroed that computes what eval mode does. For rloo.py both run each
    prompt once in their micro-batches (packed rows, which checkpointing recomputes alike)."""
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


REDUCE = """
import sys, torch
sys.path.insert(0, {repo!r})
import infra
from accelerate import Accelerator

accelerator = Accelerator(kwargs_handlers=infra.run.process_group_kwargs())
rank = accelerator.process_index
stats = {{"loss/policy_avg": torch.tensor(1.0 + rank), "vllm/logprob_diff_max": torch.tensor([0.5, 0.25][rank])}}
if accelerator.is_main_process:
    print("REDUCED", infra.outputs.reduce_stats(accelerator, stats))
else:
    infra.outputs.reduce_stats(accelerator, stats)
accelerator.wait_for_everyone()
accelerator.end_training()  # (a process leaving the group before the other aborts it)
"""


def test_statistics_are_averaged_over_processes_and_maxima_maxed(tmp_path):
    """A metric named *_max is the largest of the processes' values, the others their mean."""
    from conftest import REPO

    (tmp_path / "reduce.py").write_text(REDUCE.format(repo=REPO))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1"]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no", "--multi_gpu", str(tmp_path / "reduce.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "ACCELERATE_USE_CPU": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reduced = eval(proc.stdout.split("REDUCED", 1)[1].strip().splitlines()[0])
    assert reduced == {"loss/policy_avg": 1.5, "vllm/logprob_diff_max": 0.5}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shipped GPU config runs as meant on a GPU")
def test_the_gpu_config_without_a_gpu_is_refused_in_one_line(tmp_path, tiny_model_dir, tiny_prompts_file):
    """configs/multi_gpu.yaml (num_processes set to 2) on a machine without a GPU: accelerate starts processes that
    would each train alone (no process group); the script stops in one line naming the CPU launch, nothing written."""
    from conftest import REPO

    text = open(os.path.join(REPO, "configs", "multi_gpu.yaml")).read()
    config = tmp_path / "multi_gpu.yaml"
    config.write_text(text.replace("num_processes: 8", "num_processes: 2"))
    out = tmp_path / "out"
    args = f"--model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --output_dir {out}"
    proc = launch(2, "rloo.py", args, cwd=tmp_path, config=config)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and lines, proc.stderr[-2000:]
    assert lines[0].startswith("error: accelerate started 2 processes that would not share their gradients")
    assert lines[0].endswith("on a CPU: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N")
    assert not out.exists()
