"""--use_vllm: a vLLM engine samples the rollouts (vLLM's CPU build here; see the README for the install). The
engine's logprobs against the trainer's, the weight sync, truncated importance sampling, and rloo.py / grpo.py run
with it as a user would: learning, and a kill -9 then --resume giving the uninterrupted run."""

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import REPO, kill_after_rows
from test_rloo import VOWELS, check_ok, read_metrics

sys.path.insert(0, REPO)
import utils  # noqa: E402

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
EAGER = "--use_vllm --vllm_enforce_eager"  # compiled graphs take a minute to build on a CPU


def test_truncated_importance_weights_match_a_naive_loop():
    torch.manual_seed(0)
    logprobs, engine = -torch.rand(4, 6) * 3, -torch.rand(4, 6) * 3
    padding = torch.zeros(4, 6, dtype=torch.bool)
    padding[1, 4:], padding[3, 1:] = True, True
    cap = 1.5
    tokens, stats = utils.truncated_importance_weights(logprobs, engine, padding, cap=cap)
    sequences, _ = utils.truncated_importance_weights(logprobs, engine, padding, cap=cap, level="sequence")
    diffs, capped, real = [], 0, 0
    for i in range(4):
        total = 0.0
        for t in range(6):
            if padding[i, t]:
                assert tokens[i, t] == 1.0  # padding weighs nothing in a loss that masks it, and never overflows
                continue
            d = (logprobs[i, t] - engine[i, t]).item()
            total += d
            diffs.append(abs(d))
            real += 1
            capped += pow(2.718281828459045, d) > cap
            assert tokens[i, t].item() == pytest.approx(min(pow(2.718281828459045, d), cap), rel=1e-5)
        assert sequences[i].item() == pytest.approx(min(pow(2.718281828459045, total), cap), rel=1e-5)
    assert stats["vllm/logprob_diff_mean"].item() == pytest.approx(sum(diffs) / real, rel=1e-5)
    assert stats["vllm/logprob_diff_max"].item() == pytest.approx(max(diffs), rel=1e-5)
    assert stats["vllm/capped_fraction"].item() == pytest.approx(capped / real)


ENGINE = """
import sys, types, torch
sys.path.insert(0, {repo!r})
import infra, utils
from transformers import AutoModelForCausalLM

policy = AutoModelForCausalLM.from_pretrained({model!r}).eval()
args = types.SimpleNamespace(bf16=False, seed=1, max_prompt_length=32, response_length=12, vllm_gpu_memory_utilization=0.3,
                             vllm_tensor_parallel_size=1, vllm_enforce_eager=True)
engine = infra.vllm_engine(args, policy)
queries, mask = utils.left_pad([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]], pad_token_id=0)

def worst(model, seeds):
    # the engine's logprobs of its samples against the trainer's: logits / temperature of the same model
    responses, engine_logprobs = utils.vllm_generate(engine, queries, mask, k=3, max_tokens=12, temperature=0.7,
                                                     stop_token_id={eos}, seeds=seeds, pad_token_id=0)
    q, m = queries.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)
    responses, lengths = utils.truncate_response(responses, {eos}, 0)
    padding = torch.arange(responses.shape[1])[None, :] >= lengths[:, None]
    with torch.no_grad():
        logits = utils.forward(model, torch.cat([q, responses], 1), torch.cat([m, (~padding).long()], 1)).logits
    ours = utils.logprobs_from_logits(logits[:, q.shape[1] - 1 : -1], responses, 0.7)
    assert len(set(map(tuple, responses.tolist()))) > 1  # the k samples of a prompt differ (a seed each)
    return (ours - engine_logprobs).masked_fill(padding, 0).abs().max().item(), responses

{body}
"""


def run_engine(body, model, eos, tmp_path):
    code = ENGINE.format(repo=REPO, model=model, eos=eos, body=textwrap.dedent(body))
    (tmp_path / "engine.py").write_text(code)
    proc = subprocess.run([sys.executable, str(tmp_path / "engine.py")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@needs_vllm
def test_engine_logprobs_equal_the_trainers_before_and_after_an_update(tmp_path, tiny_llama_dir):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tiny_llama_dir).eos_token_id
    out = run_engine(
        """
        utils.vllm_sync(engine, policy)  # the engine starts with random weights
        before, first = worst(policy, seeds=[1, 2, 3])
        again = worst(policy, seeds=[1, 2, 3])[1]
        with torch.no_grad():  # an optimiser step, as far as the engine can tell
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        stale = worst(policy, seeds=[1, 2, 3])[0]  # not synced: the engine still samples from the old weights
        utils.vllm_sync(engine, policy)
        after = worst(policy, seeds=[1, 2, 3])[0]
        print("RESULT", before, bool(torch.equal(first, again)), stale, after)
        """,
        tiny_llama_dir,
        eos,
        tmp_path,
    )
    before, same, stale, after = out.split("RESULT")[1].split()
    assert float(before) < 1e-4 and float(after) < 1e-4  # fp32: the engine's distribution is the trainer's
    assert same == "True"  # the same seeds, the same samples
    assert float(stale) > 1e-2  # so the test would see a sync that did nothing


def vllm_command(script, model, prompts, out, extra=""):
    k = {"rloo.py": "--rloo_k 4", "grpo.py": "--num_generations 4", "ppo.py": ""}[script]
    return (
        f"{script} {k} {EAGER} --model_name_or_path {model} --dataset_name {prompts} --output_dir {out}"
        f" --num_sample_generations 0 --response_length 12 {extra}"
    )


@needs_vllm
@pytest.mark.parametrize("script", ["rloo.py", "grpo.py"])
def test_learns_as_fast_per_episode_as_without_vllm(script, run, tmp_path, tiny_llama_dir, tiny_prompts_file):
    (tmp_path / "reward.py").write_text(VOWELS)
    extra = (
        f"--reward_fn {tmp_path}/reward.py:vowels --total_episodes 1280 --per_device_train_batch_size 64"
        " --gradient_accumulation_steps 1 --learning_rate 3e-2 --temperature 1.0 --no_save_model"
    )
    if script == "rloo.py":
        extra += " --normalize_advantage --kl_coef 0.01"
    gains, means = {}, {}
    for mode in ("vllm", "plain"):
        out = tmp_path / mode
        command = vllm_command(script, tiny_llama_dir, tiny_prompts_file, out, extra)
        check_ok(run(command if mode == "vllm" else command.replace(EAGER, ""), cwd=tmp_path))
        rows = read_metrics(out)
        scores = [r["objective/scores"] for r in rows]
        gains[mode] = sum(scores[-5:]) / 5 - sum(scores[:5]) / 5
        means[mode] = sum(scores) / len(scores)  # the area under the learning curve, less noisy than its end
        if mode == "vllm":  # the engine's samples, weighed by the trainer's logprobs
            assert all(r["vllm/logprob_diff_max"] < 1e-3 for r in rows), [r["vllm/logprob_diff_max"] for r in rows]
        else:
            assert not any(k.startswith("vllm/") for k in rows[0])
    assert gains["vllm"] > 0.1 and gains["plain"] > 0.1, gains
    assert means["vllm"] > means["plain"] - 0.05, means


@needs_vllm
def test_kill_then_resume_with_vllm_gives_the_uninterrupted_metrics(run, tmp_path, tiny_llama_dir, tiny_prompts_file):
    (tmp_path / "reward.py").write_text(VOWELS)
    extra = f"--reward_fn {tmp_path}/reward.py:vowels --total_episodes 96 --per_device_train_batch_size 8 --checkpoint_every 1"
    full = tmp_path / "full"
    check_ok(run(vllm_command("grpo.py", tiny_llama_dir, tiny_prompts_file, full, extra), cwd=tmp_path))
    rows = read_metrics(full)

    cut = tmp_path / "cut"
    script, *args = vllm_command("grpo.py", tiny_llama_dir, tiny_prompts_file, cut, extra).split()
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, script), *args], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    assert kill_after_rows(proc, cut, 3) < len(rows)
    check_ok(run(vllm_command("grpo.py", tiny_llama_dir, tiny_prompts_file, cut, extra + " --resume"), cwd=tmp_path))
    without_eps = [[{k: v for k, v in r.items() if k != "eps"} for r in x] for x in (rows, read_metrics(cut))]
    assert without_eps[0] == without_eps[1]
    shutil.rmtree(cut)


@needs_vllm
def test_refusals_are_one_line(run, tmp_path, tiny_llama_dir, tiny_prompts_file):
    for script, extra, expected in [
        ("ppo.py", "--vllm_tensor_parallel_size 0", "error: --vllm_gpu_memory_utilization must be in (0, 1]"),
        ("grpo.py", "--use_peft", "error: --use_vllm does not work with --use_peft yet"),
        ("grpo.py", "--vllm_importance_sampling_cap 0", "error: --vllm_importance_sampling_cap must be positive"),
    ]:
        proc = run(f"{script} --use_vllm --model_name_or_path {tiny_llama_dir} --dataset_name {tiny_prompts_file} {extra}",
                   cwd=tmp_path)  # fmt: skip
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode != 0 and last.startswith(expected), last


@needs_vllm
@pytest.mark.parametrize("script", ["rloo.py", "grpo.py", "ppo.py"])
def test_the_importance_weights_scale_the_loss(script, run, tmp_path, tiny_llama_dir, tiny_prompts_file):
    (tmp_path / "reward.py").write_text(VOWELS)
    extra = f"--reward_fn {tmp_path}/reward.py:vowels --total_episodes 32 --per_device_train_batch_size 16 --no_save_model"
    losses = {}
    for cap in (3.0, 1e-9):  # a cap below every ratio: each sample's weight is the cap
        out = tmp_path / str(cap)
        command = vllm_command(script, tiny_llama_dir, tiny_prompts_file, out, f"{extra} --vllm_importance_sampling_cap {cap}")
        check_ok(run(command, cwd=tmp_path))
        (row,) = read_metrics(out)
        losses[cap] = row["loss/policy_avg"]
        assert row["vllm/capped_fraction"] == (1.0 if cap < 1 else 0.0)
    assert losses[1e-9] == pytest.approx(losses[3.0] * 1e-9, rel=1e-3, abs=1e-15) and losses[3.0] != 0
