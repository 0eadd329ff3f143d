"""--use_vllm: a vLLM engine samples the rollouts (vLLM's CPU build here; see the README for the install). The
engine's logprobs against the trainer's, the weight sync, truncated importance sampling, and rloo.py / grpo.py run
with it as a user would: learning, and a kill -9 then --resume giving the uninterrupted run."""

import importlib.util
import json
import math
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


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("clip_min, clip_max", [(None, 1.5), (0.5, 1.5), (0.8, None)])
def test_importance_weights_match_a_naive_loop(mode, clip_min, clip_max):
    """TRL's four modes: the trainer's probability over the engine's, per token or per completion, clipped to
    [clip_min, clip_max] (truncate) or zero outside it (mask); padding weighs 1 and counts in no metric."""
    torch.manual_seed(0)
    logprobs, engine = -torch.rand(6, 5) * 2, -torch.rand(6, 5) * 2
    padding = torch.zeros(6, 5, dtype=torch.bool)
    padding[1, 3:], padding[3, 1:] = True, True
    weights, stats = utils.importance_weights(logprobs, engine, ~padding, mode=mode, clip_min=clip_min, clip_max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max

    def weigh(ratio):
        if mode.endswith("truncate"):
            return min(max(ratio, low), high)
        return ratio if low <= ratio <= high else 0.0

    diffs, outside, counted = [], 0, 0
    for i in range(6):
        total = 0.0
        for t in range(5):
            if padding[i, t]:
                if mode.startswith("token"):
                    assert weights[i, t] == 1.0  # weighs nothing in a loss that masks it, and never overflows
                continue
            d = (logprobs[i, t] - engine[i, t]).item()
            total += d
            diffs.append(abs(d))
            if mode.startswith("token"):
                assert weights[i, t].item() == pytest.approx(weigh(math.exp(d)), rel=1e-5)
                outside += not low <= math.exp(d) <= high
                counted += 1
        if mode.startswith("sequence"):
            assert weights[i].item() == pytest.approx(weigh(math.exp(total)), rel=1e-5)
            outside += not low <= math.exp(total) <= high
            counted += 1
    assert stats["vllm/logprob_diff_mean"].item() == pytest.approx(sum(diffs) / len(diffs), rel=1e-5)
    assert stats["vllm/logprob_diff_max"].item() == pytest.approx(max(diffs), rel=1e-5)
    assert stats["vllm/capped_fraction"].item() == pytest.approx(outside / counted)
    assert 0 < outside < counted  # the bounds act on some weights, not all


ENGINE = """
import functools, random, sys, types, numpy, torch
sys.path.insert(0, {repo!r})
import infra, utils
from transformers import AutoModelForCausalLM

policy = AutoModelForCausalLM.from_pretrained({model!r}).eval()
args = types.SimpleNamespace(bf16=False, seed=1, max_prompt_length=32, response_length=12, vllm_gpu_memory_utilization=0.3,
                             vllm_tensor_parallel_size=1, vllm_enforce_eager=True)
draw = lambda: (torch.rand(3).tolist(), random.random(), numpy.random.rand())  # the run's random streams
streams = torch.get_rng_state(), random.getstate(), numpy.random.get_state()
expected = draw()
torch.set_rng_state(streams[0]); random.setstate(streams[1]); numpy.random.set_state(streams[2])
accelerator = types.SimpleNamespace(num_processes=1, local_process_index=0, is_main_process=True)
engine = infra.engine.vllm_engine(accelerator, args, policy)
streams_kept = draw() == expected  # the engine seeds them as it starts; vllm_engine puts them back
queries, mask = infra.data.left_pad([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]], pad_token_id=0)

def worst(model, seeds):
    # the engine's logprobs of its samples against the trainer's: logits / temperature of the same model
    responses, engine_logprobs = infra.engine.vllm_generate(engine, queries, mask, k=3, max_tokens=12, rule=0.7,
                                                     stop_token_id={eos}, seeds=seeds, pad_token_id=0)
    q, m = queries.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)
    responses, lengths = infra.data.truncate_response(responses, {eos}, 0)
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
        infra.engine.vllm_sync(engine, policy)  # the engine starts with random weights
        before, first = worst(policy, seeds=[1, 2, 3])
        again = worst(policy, seeds=[1, 2, 3])[1]
        with torch.no_grad():  # an optimiser step, as far as the engine can tell
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        stale = worst(policy, seeds=[1, 2, 3])[0]  # not synced: the engine still samples from the old weights
        infra.engine.vllm_sync(engine, policy)
        after = worst(policy, seeds=[1, 2, 3])[0]

        # top-k, top-p, min-p and a repetition penalty: the engine samples from utils.sampling_logits' distribution (its
        # logprobs are those of what it samples from), every token one the rule keeps
        rule = functools.partial(
            utils.sampling_logits, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2
        )
        drawn, drawn_logprobs = infra.engine.vllm_generate(engine, queries, mask, k=3, max_tokens=12, rule=rule,
                                                           stop_token_id=None, seeds=[4, 5, 6], pad_token_id=0)
        q, m = queries.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)
        with torch.no_grad():
            logits = utils.forward(policy, torch.cat([q, drawn], 1), torch.cat([m, torch.ones_like(drawn)], 1)).logits
        logits, present = logits[:, q.shape[1] - 1 : -1], infra.decode.seen_tokens(q, m, logits.shape[-1], rule)
        ruled, kept = [], []
        for t in range(drawn.shape[1]):
            step = torch.log_softmax(rule(logits[:, t], present), -1)
            ruled.append(step.gather(1, drawn[:, t : t + 1])[:, 0])
            kept.append((step > -float("inf")).float().sum(1).mean().item())
            present.scatter_(1, drawn[:, t : t + 1], True)
        truncated = (torch.stack(ruled, 1) - drawn_logprobs).abs().max().item()
        narrowed = sum(kept) / len(kept)  # the tokens the rule keeps at a step

        # LoRA: the engine gets each adapted weight plus its adapters' product, and the model's weights stay as they were
        from peft import LoraConfig, get_peft_model
        frozen = {n: p.clone() for n, p in policy.named_parameters()}
        lora = get_peft_model(policy, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        with torch.no_grad():  # trained adapters (lora_B starts at zero: the product would be nothing)
            for name, p in lora.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
        lora_stale = worst(lora, seeds=[1, 2, 3])[0]
        infra.engine.vllm_sync(engine, lora)
        lora_after = worst(lora, seeds=[1, 2, 3])[0]
        now = {n.replace(".base_layer", ""): p for n, p in lora.get_base_model().named_parameters() if "lora_" not in n}
        untouched = now.keys() == frozen.keys() and all(torch.equal(now[n], p) for n, p in frozen.items())
        # a prompt of 40 tokens asking 12 more of an engine of 44 (max_prompt_length + response_length): cut at 4
        try:
            long, mask = infra.data.left_pad([list(range(5, 45))], 0)
            infra.engine.vllm_generate(engine, long, mask, k=1, max_tokens=12, rule=1.0,
                                stop_token_id=None, seeds=[1], pad_token_id=0)
            capped = "not-stopped"
        except SystemExit as e:
            capped = "stopped" if "cut a completion at 4 of its 12 tokens" in str(e) and len(str(e).splitlines()) == 1 else "x"
        print("RESULT", before, bool(torch.equal(first, again)), stale, after, lora_stale, lora_after, untouched, streams_kept,
              capped, truncated, narrowed)
        """,
        tiny_llama_dir,
        eos,
        tmp_path,
    )
    result = out.split("RESULT")[1].split()
    before, same, stale, after, lora_stale, lora_after, untouched, streams_kept, capped, truncated, narrowed = result
    assert float(before) < 1e-4 and float(after) < 1e-4  # fp32: the engine's distribution is the trainer's
    assert same == "True"  # the same seeds, the same samples
    assert float(stale) > 1e-2  # so the test would see a sync that did nothing
    assert float(lora_after) < 1e-4 and float(lora_stale) > 1e-2  # the policy with its adapters, not without
    assert untouched == "True"  # the frozen weights (also the reference) are not rounded by a merge and unmerge
    assert streams_kept == "True"  # each process's own random streams, as seeded, survive the engine's start
    # a completion the engine cut at its context's end stops the run in one line, its padding never read as a stop token
    assert capped == "stopped"
    # --top_k 20 --top_p 0.9 --min_p 0.05 --repetition_penalty 1.2 asked of the engine: the rule's distribution
    assert float(truncated) < 1e-4 and 1 < float(narrowed) <= 20, (truncated, narrowed)


def vllm_command(script, model, prompts, out, extra=""):
    k = {"rloo.py": "--rloo_k 4", "grpo.py": "--num_generations 4", "ppo.py": ""}[script]
    return (
        f"{script} {k} {EAGER} --model_name_or_path {model} --dataset_name {prompts} --output_dir {out}"
        f" --num_sample_generations 0 --response_length 12 {extra}"
    )


@needs_vllm
@pytest.mark.parametrize("script", ["rloo.py"])  # (grpo.py's engine path: the importance-weight tests)
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
def test_bf16_and_gradient_checkpointing_run_with_vllm(run, tmp_path, tiny_llama_dir, tiny_prompts_file):
    """A bf16 engine (and trainer) with gradient checkpointing: the run goes through, and the mismatch metrics see
    the bf16 engine's logprobs differ from the trainer's where fp32's agree within 1e-4. Two iterations over the
    batch: grpo.py's rollout computes the logprobs the engine's samples are weighed with (the other tests of grpo.py
    take its on-policy shortcut, where the update's own pass computes them)."""
    (tmp_path / "reward.py").write_text(VOWELS)
    extra = f"--reward_fn {tmp_path}/reward.py:vowels --total_episodes 32 --per_device_train_batch_size 16 --no_save_model"
    check_ok(run(vllm_command("grpo.py", tiny_llama_dir, tiny_prompts_file, tmp_path / "out",
                              f"{extra} --bf16 --gradient_checkpointing --num_iterations 2"), cwd=tmp_path))  # fmt: skip
    (row,) = read_metrics(tmp_path / "out")
    assert 1e-4 < row["vllm/logprob_diff_mean"] < 0.05 and row["vllm/logprob_diff_max"] < 0.5, row


@needs_vllm
def test_transformers_model_and_structured_outputs_in_the_engine(run, tmp_path, tiny_llama_dir, tiny_prompts_file):
    """--vllm_model_impl transformers: vLLM runs transformers' model, given the policy's weights as its own (the
    engine's start checks its logprobs against the trainer's), with --vllm_max_model_length's context; with
    --vllm_structured_outputs_regex every completion the engine draws is the regex's (up to --response_length)"""
    import re

    (tmp_path / "reward.py").write_text(VOWELS)
    extra = f"--reward_fn {tmp_path}/reward.py:vowels --total_episodes 32 --per_device_train_batch_size 16 --no_save_model"
    extra += " --log_completions --vllm_model_impl transformers --vllm_max_model_length 200"
    proc = run(vllm_command("grpo.py", tiny_llama_dir, tiny_prompts_file, tmp_path / "out",
                            f"{extra} --vllm_structured_outputs_regex '[ab]+'"), cwd=tmp_path)  # fmt: skip
    check_ok(proc)
    assert "model_impl transformers, max_model_len 200)" in proc.stdout, proc.stdout[-2000:]
    with open(tmp_path / "out" / "completions.jsonl") as f:
        completions = [json.loads(line)["completion"] for line in f]
    assert len(completions) == 32 and all(re.fullmatch("[ab]+", c) for c in completions), completions[:4]


@needs_vllm
def test_refusals_are_one_line(run, tmp_path, tiny_llama_dir, tiny_prompts_file):
    for script, extra, expected in [
        ("ppo.py", "--vllm_tensor_parallel_size 0", "error: --vllm_tensor_parallel_size must be at least 1, got 0"),
        ("grpo.py", "--vllm_importance_sampling_cap 0", "error: --vllm_importance_sampling_clip_max must be > 0"),
        ("rloo.py", "--vllm_importance_sampling_mode token_mask", "error: RLOO's ratio is the completion's"),
        ("grpo.py", "--dynamic_sampling --use_score_scaling --score_clip 1", "error: --dynamic_sampling filters on clipped"),
        ("grpo.py", "--vllm_max_model_length 100", "error: --vllm_max_model_length 100 is less than the 152 tokens"),
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
    for cap in (3.0, 1e-9):  # a cap below every ratio: each sample's weight is the cap (set by TRL's deprecated name)
        out = tmp_path / str(cap)
        name = "clip_max" if cap > 1 else "cap"
        command = vllm_command(
            script, tiny_llama_dir, tiny_prompts_file, out, f"{extra} --vllm_importance_sampling_{name} {cap}"
        )
        check_ok(run(command, cwd=tmp_path))
        (row,) = read_metrics(out)
        losses[cap] = row["loss/policy_avg"]
        assert row["vllm/capped_fraction"] == (1.0 if cap < 1 else 0.0)
    assert losses[1e-9] == pytest.approx(losses[3.0] * 1e-9, rel=1e-3, abs=1e-15) and losses[3.0] != 0


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory, tiny_llama_dir, tiny_prompts_file):
    """rloo.py with --use_vllm, 16 completions per update in micro-batches of 4; the one-process run made once."""
    from test_distributed import launch

    folder = tmp_path_factory.mktemp("vllm_runs")
    (folder / "reward.py").write_text(VOWELS)
    args = (
        f"--rloo_k 4 {EAGER} --model_name_or_path {tiny_llama_dir} --dataset_name {tiny_prompts_file}"
        f" --reward_fn {folder}/reward.py:vowels --total_episodes 48 --per_device_train_batch_size 4 --num_ppo_epochs 2"
        " --response_length 8 --temperature 1.0 --learning_rate 1e-3 --num_sample_generations 0"
    )
    one = folder / "one"
    check_ok(launch(1, "rloo.py", f"{args} --gradient_accumulation_steps 4 --output_dir {one}", folder))
    return args, one


@needs_vllm
@pytest.mark.parametrize("config", ["plain", "zero2", "zero3"])
def test_two_processes_with_vllm_match_one(config, tmp_path, vllm_runs):
    """An engine in each process samples that process's share of the prompts with the seeds the one-process run gives
    them, so two processes x 2 micro-batches give the one-process run's completions, metrics and model, under each
    shipped way to run several processes (under ZeRO-3 the sync gathers the sharded weights). Under ZeRO-3 the run is
    also killed with SIGKILL (the launcher and both processes, each with its engine, possibly mid-checkpoint) and
    resumed: the engines' seeds come from the data's generator, which the checkpoint holds, so the resumed rollouts
    are the ones the uninterrupted run sampled."""
    from test_distributed import assert_same_run, launch, shipped_config

    args, one = vllm_runs
    two, config_path = tmp_path / "two", shipped_config(config, 2, tmp_path)
    command = f"{args} --gradient_accumulation_steps 2 --output_dir {two}"
    if config == "zero3":
        command += " --checkpoint_every 1"
        proc = launch(2, "rloo.py", command, tmp_path, config_path, wait=False)
        assert kill_after_rows(proc, two, 2, group=True) == 2  # (checkpoint 1 complete, as row 2 was logged after it)
        command += " --resume"
    proc = launch(2, "rloo.py", command, tmp_path, config_path)
    check_ok(proc)
    assert "world_size=2" in proc.stdout
    assert_same_run(one, two, "rloo.py")
    rows = read_metrics(two)
    assert all(r["vllm/logprob_diff_max"] < 1e-3 for r in rows)  # each engine has the policy's current weights
    assert rows[0]["objective/scores"] != rows[-1]["objective/scores"]


def save_family(name, tokenizer_dir, path):
    """tests/test_families.py's miniature of a family, with vLLM-sized heads and the tiny tokenizer's vocabulary."""
    from test_families import vllm_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = vllm_config(name)
    config.vocab_size, config.eos_token_id = len(tokenizer), tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@needs_vllm
@pytest.mark.parametrize("script", ["rloo_tldr.py", "ppo_tldr.py"])
def test_tldr_scripts_run_gpt_neox_with_vllm(script, run, tmp_path, tiny_tokenizer_dir, tiny_reward_model_dir, tldr_dir):
    """GPT-NeoX (Pythia), the TL;DR scripts' family, which vLLM runs on transformers' own classes: the engine starts
    beside the trainer's models of those classes, and samples what the trainer's policy would (fp32)."""
    from test_tldr import small

    model = save_family("gpt_neox", tiny_tokenizer_dir, tmp_path / "neox")
    out = tmp_path / "out"
    proc = run(small(script, tldr_dir, model, tiny_reward_model_dir, out, f"{EAGER} --total_episodes 16 --no_save_model"),
               tmp_path)  # fmt: skip
    check_ok(proc)
    rows = [r for r in read_metrics(out) if "vllm/logprob_diff_max" in r]
    assert len(rows) == 1 and rows[0]["vllm/logprob_diff_max"] < 1e-3, rows
    # what a user sees of vLLM: one line saying the engine started, not its log (errors only)
    assert "vLLM engine ready in" in proc.stdout and "(MainProcess" not in proc.stdout + proc.stderr
    lines = (proc.stdout + proc.stderr).splitlines()
    assert not [line for line in lines if "vllm" in line.lower() and not line.startswith(("│", "vLLM engine ready"))]


@needs_vllm
@pytest.mark.parametrize(
    "family, message",
    [
        ("head16", "error: --use_vllm: vLLM's CPU attention takes head sizes 32, 64"),  # the test suite's tiny GPT-NeoX
        ("gpt_neo", "error: --use_vllm: vLLM cannot run this gpt_neo model (1 validation error"),  # no model in vLLM
        ("mixtral", "error: --use_vllm: vLLM's logprobs of this mixtral model differ from the trainer's"),  # not reloaded
    ],
)
def test_what_vllm_cannot_run_is_refused_in_one_line(family, message, run, tmp_path, tiny_model_dir, tiny_tokenizer_dir,
                                                     tiny_prompts_file):  # fmt: skip
    """A model vLLM cannot run, or runs otherwise than the trainer, stops the run in one line before any update:
    benchmark/results/vllm/families has the whole family matrix."""
    model = tiny_model_dir if family == "head16" else save_family(family, tiny_tokenizer_dir, tmp_path / family)
    out = tmp_path / "out"
    proc = run(vllm_command("rloo.py", model, tiny_prompts_file, out, "--total_episodes 16 --per_device_train_batch_size 8"),
               tmp_path)  # fmt: skip
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and last.startswith(message), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (out / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def eos_neox_dir(tmp_path_factory, tiny_tokenizer_dir):
    """A GPT-NeoX with vLLM-sized heads that produces its EOS token about a third of the time, so that completions end
    at different lengths."""
    from conftest import stop_a_third_of_the_time

    path = save_family("gpt_neox", tiny_tokenizer_dir, tmp_path_factory.mktemp("eos_neox"))
    return stop_a_third_of_the_time(path, path)


# the group holding a call's longest completion (in characters) gets one score, every other completion its own
LONGEST_FLAT = """
import zlib

def longest_flat(prompts, completions):
    longest = max(range(len(completions)), key=lambda i: len(completions[i])) // 4
    return [1.0 if i // 4 == longest else zlib.crc32(c.encode()) % 1000 / 1000 for i, c in enumerate(completions)]
"""


@needs_vllm
@pytest.mark.parametrize("script", ["grpo.py", "rloo.py"])
def test_dynamic_sampling_with_vllm_and_the_other_rollout_flags(script, run, tmp_path, eos_neox_dir, tiny_prompts_file):
    """--dynamic_sampling with --use_vllm, where the kept groups are all shorter than a dropped one (so the batch is
    narrower than the round that sampled it, and the engine's logprobs must be cut with the completions), together
    with the other rollout flags that can meet them: a drawn length bound, score scaling and, in grpo.py, the overlong
    filter. (The missing-EOS penalty would make the longest group's scores differ: tests/test_knobs_scores.py.)"""
    (tmp_path / "reward.py").write_text(LONGEST_FLAT)
    extra = (
        f"--reward_fn {tmp_path}/reward.py:longest_flat --dynamic_sampling --max_sampling_rounds 2 --total_episodes 48"
        " --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --temperature 1.0 --no_save_model"
        " --response_length_min 6 --use_score_scaling --use_score_norm"
    )
    if script == "grpo.py":
        extra += " --mask_truncated_completions"
    out = tmp_path / "out"
    check_ok(run(vllm_command(script, eos_neox_dir, tiny_prompts_file, out, extra), cwd=tmp_path))
    rows = read_metrics(out)
    assert len(rows) == 3 and all(r["vllm/logprob_diff_max"] < 1e-3 for r in rows), rows
    assert sum(r["dynamic_sampling/dropped"] for r in rows) >= 3  # a group dropped in every update


@needs_vllm
def test_the_engine_stops_at_the_stop_token_only(tmp_path, eos_neox_dir):
    """As infra.decode.generate: with no stop token every completion runs to its full length, though the model's EOS token
    (which vLLM would otherwise stop at, from the model's config) is sampled; with a stop token, at it."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(eos_neox_dir).eos_token_id
    out = run_engine(
        f"""
        infra.engine.vllm_sync(engine, policy)
        never = infra.engine.vllm_generate(engine, queries, mask, k=3, max_tokens=12, rule=1.0, stop_token_id=None,
                                    seeds=[1, 2, 3], pad_token_id=0)[0]
        at_eos = infra.engine.vllm_generate(engine, queries, mask, k=3, max_tokens=12, rule=1.0, stop_token_id={eos},
                                     seeds=[1, 2, 3], pad_token_id=0)[0]
        lengths = infra.data.truncate_response(at_eos, {eos}, 0)[1]
        print("RESULT", "x".join(map(str, never.shape)), int((never == {eos}).sum()), sorted(set(lengths.tolist())))
        """,
        eos_neox_dir,
        eos,
        tmp_path,
    )
    shape, eos_sampled, lengths = out.split("RESULT")[1].strip().split(" ", 2)
    assert shape == "9x12" and int(eos_sampled) > 3  # full length, EOS tokens and all
    assert len(eval(lengths)) > 1 and min(eval(lengths)) < 12  # stopped at EOS, at different lengths


ECHO = """
class Echo:
    text_environment = True

    def reset(self, **row):
        self.turn = 0

    def step(self, completion):
        self.turn += 1
        if self.turn == 1:
            return " Once more:", 0.0, False
        return None, sum(ch in "aeiou" for ch in completion) / max(1, len(completion)), True
"""


@needs_vllm
@pytest.mark.parametrize("script", ["rloo.py", "grpo.py"])
def test_episodes_with_vllm_weigh_the_policys_tokens_only(script, run, tmp_path, tiny_llama_dir, tiny_prompts_file):
    """--environment with --use_vllm (and grpo.py with --dynamic_sampling too): the engine continues each episode from
    its tokens, and its logprobs of the policy's tokens equal the trainer's; the observations, which the engine did not
    sample, are no part of the importance weights or their mismatch metrics."""
    (tmp_path / "envs.py").write_text(ECHO)
    epochs = "--num_iterations 2 --dynamic_sampling" if script == "grpo.py" else "--num_ppo_epochs 2"
    extra = (
        f"--environment {tmp_path}/envs.py:Echo --stop_token None --total_episodes 32 --per_device_train_batch_size 16"
        f" --no_save_model {epochs}"
    )
    out = tmp_path / "out"
    command = vllm_command(script, tiny_llama_dir, tiny_prompts_file, out, extra)
    check_ok(run(command.replace("--response_length 12", "--response_length 6"), cwd=tmp_path))
    (row,) = read_metrics(out)
    assert row["env/turns"] == 2 and 0.2 < row["env/policy_token_fraction"] < 0.8
    assert row["vllm/logprob_diff_max"] < 1e-3, row


@needs_vllm
def test_the_calculator_with_vllm_within_the_models_context(run, tmp_path, caller_model_dir):
    """The calculator's documented command with --use_vllm, on a model that calls its tools and reads 600 positions
    (the tiny tokenizer renders the prompt with its tool in 462 tokens): the engine holds an episode's whole budget
    within them (not one turn's), episodes run several turns past one turn's budget to the context's end, and every
    token the policy trained on is one the engine sampled (a padded stop token would differ from the trainer's
    logprob by far more)."""
    from transformers import AutoConfig

    model = tmp_path / "caller600"
    shutil.copytree(caller_model_dir, model)
    config = AutoConfig.from_pretrained(model)
    config.max_position_embeddings = 600
    config.save_pretrained(model)
    out = tmp_path / "out"
    check_ok(run(
        f"grpo.py --dataset_name {REPO}/data/arithmetic.jsonl --reward_fn accuracy"
        f" --environment {REPO}/examples/environments/calculator.py:Calculator"
        f" --chat_template {REPO}/examples/environments/chatml_tools.jinja --max_turns 3 --response_length 48"
        f" --max_prompt_length 512 {EAGER} --model_name_or_path {model} --total_episodes 32 --temperature 1.0"
        f" --num_sample_generations 0 --no_save_model --output_dir {out}",
        cwd=tmp_path,
    ))  # fmt: skip
    rows = read_metrics(out)
    assert all(r["vllm/logprob_diff_max"] < 1e-3 for r in rows), rows
    assert all(r["env/tool_calls"] > 0.5 and r["env/turns"] > 1.3 for r in rows)
    # episodes, the policy's tokens and the observations', near one turn's budget on average; a third or more end at
    # their budget or the context, where the next observation would not fit (the engine never cut one: see above)
    assert all(r["completions/mean_length"] + r["env/observation_length"] > 40 and r["env/capped"] > 0.3 for r in rows)


@needs_vllm
def test_two_processes_with_vllm_play_one_processs_episodes(tmp_path, tiny_llama_dir, tiny_prompts_file):
    """--use_vllm --environment on two processes x 2 micro-batches: the engine seeds each later turn by the prompt,
    the turn and the row's place in its group, so the episodes, their conversations and the metrics are one
    process's x 4."""
    from test_distributed import launch

    (tmp_path / "envs.py").write_text(ECHO)
    args = (
        f"--num_generations 4 {EAGER} --model_name_or_path {tiny_llama_dir} --dataset_name {tiny_prompts_file}"
        f" --environment {tmp_path}/envs.py:Echo --stop_token None --response_length 6 --total_episodes 32"
        " --per_device_train_batch_size 4 --temperature 1.0 --learning_rate 1e-3 --num_sample_generations 0"
        " --log_completions --no_save_model"
    )
    for processes in (1, 2):
        steps = f"--gradient_accumulation_steps {4 // processes}"
        check_ok(launch(processes, "grpo.py", f"{args} {steps} --output_dir {tmp_path / str(processes)}", tmp_path))
    a, b = read_metrics(tmp_path / "1"), read_metrics(tmp_path / "2")
    assert len(a) == len(b) == 2 and all(r["env/turns"] == 2 for r in a)
    for x, y in zip(a, b):
        for key in ["reward", "reward_std", "entropy", "env/policy_token_fraction", "vllm/logprob_diff_mean"]:
            assert y[key] == pytest.approx(x[key], rel=1e-3, abs=1e-5), key

    def conversations(out):
        return sorted(json.dumps(json.loads(line)["completion"]) for line in open(out / "completions.jsonl"))

    assert conversations(tmp_path / "1") == conversations(tmp_path / "2")


@needs_vllm
def test_distillation_with_vllm(run, tmp_path, tiny_llama_dir, tiny_prompts_file):
    """distill.py with the engine sampling: the sampled form's loss weighed by the truncated importance weights (a
    cap below every ratio scales it by the cap), and --lmbda 0.5 with the JSD, whose dataset batches skip the engine."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with torch.no_grad():
        teacher.get_output_embeddings().weight.mul_(4.0)
    teacher.save_pretrained(tmp_path / "teacher")
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(tmp_path / "teacher")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(line[:-2] + ', "completion": " one two"}\n' for line in open(tiny_prompts_file)))
    base = (
        f"distill.py {EAGER} --model_name_or_path {tiny_llama_dir} --teacher_model_name_or_path {tmp_path / 'teacher'}"
        f" --dataset_name {data} --num_sample_generations 0 --response_length 12 --per_device_train_batch_size 16"
        " --gradient_accumulation_steps 1"
        " --no_save_model"
    )
    losses = {}
    for cap in (3.0, 1e-9):
        out = tmp_path / f"sampled{cap}"
        check_ok(run(f"{base} --loss sampled --total_episodes 16 --vllm_importance_sampling_cap {cap} --output_dir {out}",
                     cwd=tmp_path))  # fmt: skip
        (row,) = read_metrics(out)
        assert row["vllm/logprob_diff_max"] < 1e-3 and row["vllm/capped_fraction"] == (1.0 if cap < 1 else 0.0)
        losses[cap] = row["distill/loss"]
    assert losses[1e-9] == pytest.approx(losses[3.0] * 1e-9, rel=1e-3, abs=1e-15) and losses[3.0] != 0
    out = tmp_path / "mixed"
    check_ok(run(f"{base} --lmbda 0.5 --total_episodes 96 --output_dir {out}", cwd=tmp_path))
    rows = read_metrics(out)
    assert {r["distill/on_policy"] for r in rows} == {0.0, 1.0}
    assert all(("vllm/logprob_diff_max" in r) == (r["distill/on_policy"] == 1.0) for r in rows)
    assert all(math.isfinite(r["objective/reverse_kl"]) for r in rows)
