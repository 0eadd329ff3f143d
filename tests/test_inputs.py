"""Every input a user brings gives one line before any work: each number of every script's flags outside its range, a
malformed dataset file (named by its line), a mistyped local path (said at once, never looked up on the hub), an
unreadable reward function file; and the console says what the run does: a line per update, where it writes, how the
saved model loads, without the warnings the project knows to be harmless."""

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import typing

import pytest
from conftest import REPO
from test_rloo import check_ok, read_metrics

SCRIPTS = "rloo.py ppo.py grpo.py distill.py sft.py reward.py dpo.py kto.py ilql.py raft.py rloo_tldr.py ppo_tldr.py".split()
PROBES = {int: [-1, 0], float: [-1.0, 0.0, math.nan, math.inf], tuple: [math.nan, math.inf]}
# the probes each number may take (0 or below has a meaning there): every other probe must be refused
ALLOWED = {
    "stop_token_id": [0], "max_staleness": [0], "eval_every": [0], "num_eval_generations": [0], "seed": [0],
    "checkpoint_every": [0], "num_sample_generations": [0], "critic_warmup_updates": [0], "learning_rate": [0.0],
    "vllm_importance_sampling_clip_min": [0.0], "missing_eos_penalty": [0.0], "max_grad_norm": [0.0], "ema_beta": [0.0],
    "ptx_coef": [0.0], "kl_coef": [0.0], "cliprange": [0.0], "cliprange_value": [0.0], "vf_coef": [0.0], "gamma": [0.0],
    "lam": [0.0], "entropy_coef": [-1.0, 0.0], "top_entropy_quantile": [0.0], "epsilon": [0.0], "epsilon_high": [0.0],
    "beta": [0.0], "lmbda": [0.0], "label_smoothing": [0.0], "center_rewards_coefficient": [0.0],
    "reward_weights": [], "top_k": [0], "min_p": [0.0], "warmup_ratio": [0.0], "warmup_steps": [0], "min_lr_rate": [0.0],
    "weight_decay": [0.0], "adam_beta1": [0.0], "adam_beta2": [0.0], "off_policy_mask_threshold": [0.0],
    "vespo_k_pos": [0.0], "vespo_k_neg": [0.0], "vespo_lambda_pos": [0.0], "vespo_lambda_neg": [0.0],
    "max_tool_calling_iterations": [0], "num_generations_eval": [0], "ref_model_mixup_alpha": [0.0],
    "entropy_coef_min": [0.0], "entropy_coef_max": [0.0], "entropy_coef_delta": [0.0], "entropy_target": [0.0],
    "router_aux_loss_coef": [0.0], "desirable_weight": [0.0], "undesirable_weight": [0.0], "ld_alpha": [0.0],
    "simpo_gamma": [0.0], "cpo_alpha": [0.0], "cql_scale": [0.0], "awac_scale": [0.0], "alpha": [0.0],
    "gen_beta": [0.0], "lora_dropout": [0.0],
}  # fmt: skip
ALLOWED_IN = {
    ("dpo.py", "beta"): [],
    ("kto.py", "beta"): [],
    ("ilql.py", "temperature"): [0.0],
    ("raft.py", "min_score"): [-1.0, 0.0],
}  # (DPO's and KTO's beta divide: it must be positive)
# the flags a check needs beside the probe (cpo_alpha 0 with simpo: pure SimPO, TRL's CPOTrainer at cpo_alpha 0)
WITH = {"lora_r": {"use_peft": True}, "lora_alpha": {"use_peft": True},
        "simpo_gamma": {"loss_type": ("simpo",)}, "cpo_alpha": {"loss_type": ("simpo",)}}  # fmt: skip
# (the deprecated flag, and TRL's name, set the other)
NAMED = {"vllm_importance_sampling_cap": "vllm_importance_sampling_clip_max", "num_generations_eval": "num_eval_generations"}


class ModelLoaded(Exception):
    pass


def script_module(script):
    spec = importlib.util.spec_from_file_location(f"script_{script[:-3]}", os.path.join(REPO, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def numbers(args_cls):
    """(flag, int, float or tuple) of each number a user can set"""
    hints = typing.get_type_hints(args_cls)
    for field in dataclasses.fields(args_cls):
        if "Suppress" in str(field.type):  # (the sizes filled in at runtime)
            continue
        kinds = set(typing.get_args(hints[field.name])) | {hints[field.name]}
        if any(typing.get_origin(k) is tuple and float in typing.get_args(k) for k in kinds):
            yield field.name, tuple
        elif float in kinds:
            yield field.name, float
        elif int in kinds and bool not in kinds:
            yield field.name, int


@pytest.fixture
def offline_data(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": " yes", "rejected": " no"}) + "\n" for i in range(8)))
    examples = tmp_path / "sft.jsonl"
    examples.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": " yes"}) + "\n" for i in range(8)))
    scored = tmp_path / "scored.jsonl"
    scored.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": " yes", "reward": i / 8}) + "\n" for i in range(8)))
    files = {"sft.py": examples, "reward.py": pairs, "dpo.py": pairs, "kto.py": pairs, "ilql.py": scored}
    return {script: str(path) for script, path in files.items()}


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_number_outside_its_range_is_one_line_before_any_model_loads(
    script, tmp_path, monkeypatch, capsys, tiny_model_dir, tiny_reward_model_dir, tiny_prompts_file, tldr_dir, offline_data
):
    """Each number of the script's flags, at -1 and 0 (floats also NaN and inf), through the script's own main(): every
    probe outside the flag's range stops with status 2 and one line naming the flag, before any model loads (a model
    load raises here) and with nothing written; and the same flags without the probe reach the model load."""
    import transformers

    def load(*args, **kwargs):
        raise ModelLoaded()

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(load))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    module = script_module(script)
    out = tmp_path / "out"
    base = {"model_name_or_path": tiny_model_dir, "dataset_name": tiny_prompts_file, "output_dir": str(out)}
    if "tldr" in script:
        base = {"sft_model_path": tiny_model_dir, "reward_model_path": tiny_reward_model_dir, "dataset_name": tldr_dir}
        base["output_dir"] = str(out)
    if script in offline_data:
        base["dataset_name"] = offline_data[script]
    if script == "ilql.py":  # (its default held-out rows are chat messages, which the tiny tokenizer has no template for)
        base["eval_dataset_name"] = None
    if script == "distill.py":
        base["teacher_model_name_or_path"] = tiny_model_dir

    def outcome(flags):
        capsys.readouterr()
        try:
            module.main(module.Args(**flags))
        except ModelLoaded:
            return "loaded", None
        except SystemExit as e:
            return e.code, capsys.readouterr().err.strip().splitlines()
        return "ran", None

    assert outcome(base) == ("loaded", None)  # the harness: valid flags get as far as loading a model
    probed = 0
    for name, kind in numbers(module.Args):
        allowed = ALLOWED_IN.get((script, name), ALLOWED.get(name, []))
        for value in PROBES[kind]:
            if value in allowed or (isinstance(value, float) and math.isnan(value) and any(map(math.isnan, allowed))):
                continue
            probe = (value,) if kind is tuple else value
            code, lines = outcome({**base, **WITH.get(name, {}), name: probe})
            assert code == 2, f"--{name} {value}: {code}"
            assert lines[-1].startswith("error: ") and f"--{NAMED.get(name, name)}" in lines[-1], (name, value, lines)
            assert not out.exists() and not os.listdir(tmp_path / "cwd")
            probed += 1
    assert probed >= 20


@pytest.mark.parametrize(
    "script, flags, message",
    [
        ("rloo.py", "--per_device_train_batch_size 0", "--per_device_train_batch_size must be at least 1, got 0"),
        ("grpo.py", "--gradient_accumulation_steps 0", "--gradient_accumulation_steps must be at least 1, got 0"),
        ("sft.py", "--gradient_accumulation_steps 0", "--gradient_accumulation_steps must be at least 1, got 0"),
        ("dpo.py", "--learning_rate -1", "--learning_rate must be at least 0, got -1.0"),
        ("ppo.py", "--temperature nan", "--temperature must be a finite number, got nan"),
        ("grpo.py", """--generation_kwargs '{"top_q": 0.5}'""", "--generation_kwargs: utils.sampling_logits takes no top_q"),
        ("rloo.py", """--generation_kwargs '{"top_k": 2.5}'""", "--top_k must be an integer >= 0, got 2.5"),
        (
            "distill.py",
            """--generation_kwargs '{"temperature": 0.5}'""",
            "--generation_kwargs: give the temperature with --temperature (the logprobs read it too)",
        ),
        (
            "ppo.py",
            """--chat_template_kwargs '{"enable_thinking": false,}'""",
            """--chat_template_kwargs must be a JSON object ('{"name": value, ...}'): Expecting property name enclosed in """
            "double quotes: line 1 column 27 (char 26)",
        ),
    ],
)
def test_run_values_below_range_stop_the_process_in_one_line(script, flags, message, run, tmp_path):
    """As a user types them, with the default model: status 2, one line, nothing written."""
    (tmp_path / "cwd").mkdir()
    proc = run(f"{script} {flags}", cwd=tmp_path / "cwd")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == f"error: {message}"
    assert not os.listdir(tmp_path / "cwd")


MALFORMED = {
    "unterminated": ('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c}\n', "line 3: Unterminated string starting at"),
    "trailing_comma": ('{"prompt": "a"}\n{"prompt": "b",}\n', "line 2: Expecting property name enclosed in double quotes"),
    "truncated": ('{"prompt": "a"}\n{"prompt": "b"', "line 2: Expecting ',' delimiter"),
    "not_an_object": ('{"prompt": "a"}\n["b"]\n', "line 2: a row must be a JSON object, got list"),
}


@pytest.mark.parametrize(
    "script, case",
    [("rloo.py", "unterminated"), ("dpo.py", "trailing_comma"), ("sft.py", "truncated"), ("rloo.py", "not_an_object")],
)
def test_a_malformed_dataset_file_is_one_line_naming_the_line(script, case, run, tmp_path, tiny_model_dir):
    """Each slip as a script reads it (each slip in every reader: test_where_a_dataset_file_fails_to_parse)."""
    text, message = MALFORMED[case]
    if script != "rloo.py":  # (the rows' columns do not matter: the file does not parse)
        text = text.replace('"prompt"', '"text"')
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    out = tmp_path / "out"
    proc = run(f"{script} --model_name_or_path {tiny_model_dir} --dataset_name {path} --output_dir {out}", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot read dataset '{path}': {path}, {message}"), last
    assert "DatasetGenerationError" not in proc.stderr and not out.exists()


def refused(proc, out):
    """the one line a run stopped with (status 2, no traceback), nothing written to out"""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()
    return proc.stderr.strip().splitlines()[-1]


PAIR = {"prompt": "q", "chosen": " yes", "rejected": " no"}
TURNS = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
# a chat template that reads each message's content (the tiny tokenizer has none)
TEMPLATE = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
NO_CONTENT = "the chat template cannot render it: 'dict object' has no attribute 'content'"


@pytest.mark.parametrize(
    "script, rows, message",
    [
        (
            "dpo.py",
            [{**PAIR, "chosen": 1}, {**PAIR, "chosen": 2}],
            "row 0: `chosen` must be a string or chat messages, got int",
        ),
        (
            "reward.py",
            [PAIR, {**PAIR, "rejected": {"text": " no"}}],
            "row 1: `rejected` must be a string or chat messages, got dict",
        ),
        (
            "kto.py",
            [{**PAIR, "chosen": 1}, {**PAIR, "chosen": 2}],
            "row 0: `chosen` must be a string or chat messages, got int",
        ),
        (
            "dpo.py",
            [{**PAIR, "prompt": TURNS[:1]}, PAIR],
            "row 0: `prompt` holds chat messages but `chosen` a string: a row's are all strings or all chat messages",
        ),
        ("dpo.py", [PAIR, PAIR, {"chosen": " y", "rejected": " n"}], "row 2: no prompt"),
        ("sft.py", [{"prompt": "q", "completion": " a"}, {"completion": " b"}], "row 1: no prompt"),
        (
            "sft.py",
            [{"messages": TURNS}, {"messages": [TURNS[0], {"role": "assistant", "content": None}]}],
            f"row 1: {NO_CONTENT}",
        ),
        ("sft.py", [{"messages": TURNS}, {"messages": [{"role": "user"}, TURNS[1]]}], f"row 1: {NO_CONTENT}"),
        (
            "reward.py",
            [{**PAIR, "margin": 1.0}, {**PAIR, "margin": None}],
            "row 1: `margin` must be a finite number, got None",
        ),
        ("reward.py", [{**PAIR, "margin": 1.0}, PAIR], "row 1: `margin` must be a finite number, got None"),
        ("rloo.py", [{"prompt": TURNS[:1]}, {"prompt": [{"role": "user"}]}], f"row 1: {NO_CONTENT}"),
        ("rloo.py", [{"prompt": "q"}, {"prompt": 3}], "row 1: `prompt` must be a string or chat messages, got int"),
        (
            "rloo.py",
            [{"prompt": TURNS[:1]}, {"prompt": []}],
            "row 1: the chat template cannot render it: Cannot apply chat template to an empty conversation. Provide at"
            " least one message.",
        ),
        (
            "reward.py",
            [{**PAIR, "margin": True}, {**PAIR, "margin": False}],
            "row 0: `margin` must be a finite number, got True",
        ),
    ],
)
def test_a_bad_row_is_one_line_naming_it(script, rows, message, run, tmp_path, tiny_model_dir):
    """A field neither a string nor chat messages, a row mixing the two, a row missing a field the others have, a
    message the chat template cannot render, a `margin` that is not a finite number (missing in one row, a bool): one
    line naming the file's row, status 2, before any model loads and with nothing written."""
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    out = tmp_path / "out"
    flags = f"--model_name_or_path {tiny_model_dir} --dataset_name {path} --chat_template {tmp_path / 'chat.jinja'}"
    proc = run(f"{script} {flags} --output_dir {out}", cwd=tmp_path)
    assert refused(proc, out) == f"error: dataset '{path}' (split 'train'), {message}"


@pytest.mark.parametrize("script", ["rloo.py", "sft.py"])
def test_a_chat_template_that_does_not_parse_is_one_line_as_it_loads(script, run, tmp_path, tiny_model_dir):
    """Said as the file loads (naming it and where it fails), not at the first row rendered, whether or not one is."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }\n{% endfor %}")
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": TURNS[:1]} if script == "rloo.py" else {"messages": TURNS}) + "\n" * 8))
    out = tmp_path / "out"
    flags = f"--model_name_or_path {tiny_model_dir} --dataset_name {path} --chat_template {template}"
    proc = run(f"{script} {flags} --output_dir {out}", cwd=tmp_path)
    assert refused(proc, out) == f"error: --chat_template file '{template}', line 1: unexpected '}}'"


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_a_model_option_whose_package_is_missing_is_one_line(run, tmp_path, tiny_model_dir, tiny_prompts_file):
    out = tmp_path / "out"
    flags = f"--model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --output_dir {out}"
    proc = run(f"""rloo.py {flags} --model_init_kwargs '{{"attn_implementation": "flash_attention_2"}}'""", cwd=tmp_path)
    assert refused(proc, out) == (
        f"error: cannot load '{tiny_model_dir}' with AutoModelForCausalLM: FlashAttention2 has been toggled on, but it "
        "cannot be used due to the following error: the package for FlashAttention2 doesn't seem to be installed."
    )


@pytest.mark.parametrize(
    "script, flags, message",
    [
        ("rloo.py", "--model_name_or_path output/no_such_sft", "--model_name_or_path 'output/no_such_sft' does not exist"),
        ("sft.py", "--model_name_or_path output/no_such_sft", "--model_name_or_path 'output/no_such_sft' does not exist"),
        ("dpo.py", "--dataset_name data/my_pairs", "--dataset_name 'data/my_pairs' does not exist"),
        ("grpo.py", "--reward_model_path output/reward", "--reward_model_path 'output/reward' does not exist"),
        ("rloo.py", "--eval_dataset_name data/test", "--eval_dataset_name 'data/test' does not exist"),
        ("rloo.py", "--reward_fn data/rewards.py:score", "--reward_fn 'data/rewards.py:score': the file 'data/rewards.py'"),
        ("reward.py", "--chat_template chat.jinja", "--chat_template 'chat.jinja' does not exist"),
    ],
)
def test_a_mistyped_local_path_is_said_at_once(script, flags, message, run, tmp_path):
    """A path that can only be local (under output/, where the scripts write, or a folder that exists here) is refused
    as it is parsed, never looked up on the hub (where, without a network, it spent a minute in retries; the tests run
    offline, where a look-up would end in another line)."""
    (tmp_path / "data").mkdir()
    proc = run(f"{script} {flags}", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(f"error: {message}"), proc.stderr
    assert os.listdir(tmp_path) == ["data"] and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "source, message",
    [
        ("def f(prompts, completions):\n    return [0.0 for c in completions\n", "line 2: '[' was never closed"),
        ("import no_such_package_xyz\n", "cannot be read or imported: No module named 'no_such_package_xyz'"),
    ],
)
def test_an_unreadable_reward_function_file_is_one_line(source, message, run, tmp_path, tiny_model_dir, tiny_prompts_file):
    (tmp_path / "rewards.py").write_text(source)
    out = tmp_path / "out"
    flags = f"--model_name_or_path {tiny_model_dir} --dataset_name {tiny_prompts_file} --output_dir {out}"
    proc = run(f"rloo.py {flags} --reward_fn {tmp_path}/rewards.py:f", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --reward_fn file '{tmp_path}/rewards.py'") and message in last, last
    assert not out.exists()


def test_the_console_tells_each_update_where_the_run_writes_and_how_the_model_loads(
    run, tmp_path, tiny_llama_dir, tiny_prompts_file
):
    """A fresh interpreter, as a user runs it, on a model with tied embeddings, checkpointing every update: a line per
    update (its score, KL, length, learning rate, speed), where it writes at the start, how the saved model loads at
    the end (the line's own call loads it), and neither DeepSpeed's "no GPU" warning nor accelerate's tied-weights one.
    With --quiet: neither the update lines nor the configuration, still where it writes (with --no_save_model: no
    model). A second run into the folder
    is refused, offering --resume only where a checkpoint exists."""
    out = tmp_path / "out"
    flags = f"--model_name_or_path {tiny_llama_dir} --dataset_name {tiny_prompts_file} --rloo_k 2 --response_length 6"
    flags += f" --total_episodes 32 --num_sample_generations 0 --checkpoint_every 1 --output_dir {out}"
    script = os.path.join(REPO, "rloo.py")
    proc = subprocess.run([sys.executable, script, *flags.split()], cwd=tmp_path, capture_output=True, text=True)
    check_ok(proc)
    lines = proc.stdout.strip().splitlines()
    assert f"writing to {out}: metrics.jsonl, TensorBoard logs (runs/), the model at the end" in lines
    updates = [line for line in lines if line.startswith("update ")]
    rows = read_metrics(out)
    assert len(updates) == len(rows) == 2
    for line, row in zip(updates, rows):
        expected = f"update {rows.index(row) + 1}/2  episode {row['episode']}  score {row['objective/scores']:.4g}  kl "
        assert line.startswith(expected) and f"  lr {row['lr']:.4g}  " in line and line.endswith(" episodes/s"), line
    last = lines[-1]
    assert last.startswith(f"done: the model in {out}, transformers.AutoModelForCausalLM.from_pretrained('{out}')"), last
    import transformers

    assert isinstance(transformers.AutoModelForCausalLM.from_pretrained(str(out)), transformers.LlamaForCausalLM)
    assert "Setting accelerator to CPU" not in proc.stderr and "Removed shared tensor" not in proc.stderr + proc.stdout

    # the rest from the tests' warm interpreter
    again = run(f"rloo.py {flags}", cwd=tmp_path)
    assert again.returncode == 2 and again.stderr.strip().splitlines()[-1].endswith("or add --resume to continue it")
    quiet = tmp_path / "quiet"
    proc = run(f"rloo.py {flags.replace(str(out), str(quiet))} --quiet --checkpoint_every 0 --no_save_model", cwd=tmp_path)
    check_ok(proc)
    assert not any(line.startswith(("update ", "Args(")) for line in proc.stdout.splitlines())
    assert f"writing to {quiet}: metrics.jsonl, TensorBoard logs (runs/)" in proc.stdout.splitlines()  # (no model)
    again = run(f"rloo.py {flags.replace(str(out), str(quiet))}", cwd=tmp_path)
    last = again.stderr.strip().splitlines()[-1]
    assert again.returncode == 2 and last.endswith("already holds a run (metrics.jsonl): choose another folder"), last


def test_where_a_dataset_file_fails_to_parse(tmp_path, capsys):
    """read_dataset's line for each kind of file: a CSV's parser message (its line), a .json file holding JSON Lines read
    line by line (as datasets reads it), a .json document by its own line, a folder's broken file named among others
    that parse (a gzipped one too)."""
    import gzip

    from infra.data import read_dataset

    def refusal(name):
        with pytest.raises(SystemExit) as stop:
            read_dataset(str(name), "train")
        assert stop.value.code == 2 and "\n" not in str(stop.value)
        return str(stop.value)

    for case, (text, message) in MALFORMED.items():
        (tmp_path / f"{case}.jsonl").write_text(text)
        assert f"{case}.jsonl, {message}" in refusal(tmp_path / f"{case}.jsonl")
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n3,4,5\n")
    assert "Expected 2 fields in line 3, saw 3" in refusal(tmp_path / "bad.csv")
    (tmp_path / "lines.json").write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c}\n')
    assert refusal(tmp_path / "lines.json").endswith("lines.json, line 3: Unterminated string starting at (column 12)")
    (tmp_path / "doc.json").write_text('[{"prompt": "a"},\n {"prompt": "b"}\n {"prompt": "c"}]\n')
    assert refusal(tmp_path / "doc.json").endswith("doc.json, line 3: Expecting ',' delimiter (column 2)")
    folder = tmp_path / "folder"
    folder.mkdir()
    with gzip.open(folder / "a.jsonl.gz", "wt") as f:
        f.write('{"prompt": "a"}\n')
    (folder / "b.jsonl").write_text('{"prompt": "b"}\n{"prompt": "b",}\n')
    assert refusal(folder).endswith("b.jsonl, line 2: Expecting property name enclosed in double quotes (column 16)")


def test_a_folder_written_by_save_to_disk_loads(tmp_path):
    """read_dataset: a Dataset's save_to_disk folder (load_dataset refuses it) as the Dataset, of the split asked where
    it names one (else one line); a DatasetDict's, the split asked"""
    import datasets

    from infra.data import read_dataset

    rows = [{"prompt": f"Write about {w}"} for w in ("rain", "snow", "fog")]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "plain"))
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    named = datasets.load_dataset("json", data_files={"train": str(tmp_path / "r.jsonl")}, split="train")
    named.save_to_disk(str(tmp_path / "named"))
    datasets.DatasetDict({"train": named, "test": named.select([0])}).save_to_disk(str(tmp_path / "dict"))
    assert read_dataset(str(tmp_path / "plain"), "validation").to_list() == rows
    assert read_dataset(str(tmp_path / "named"), "train").to_list() == rows
    assert read_dataset(str(tmp_path / "dict"), "test").to_list() == rows[:1]
    with pytest.raises(SystemExit) as stop:
        read_dataset(str(tmp_path / "named"), "test")
    assert str(stop.value) == f"error: dataset {str(tmp_path / 'named')!r} holds the split 'train' alone, not 'test'"


def test_which_paths_are_local(tmp_path, monkeypatch, capsys):
    """check_paths: a hub id is left to the hub even where a folder of its owner's name is here; a path holding '=' is a
    reward function's file, not a name; data/... missing here is the repository's (said in a note); a path missing its
    file type is refused with the file it may mean."""
    from types import SimpleNamespace

    from infra.data import REPO, check_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "trl-lib").mkdir()
    (tmp_path / "run=3").mkdir()
    (tmp_path / "run=3" / "rewards.py").write_text("def f(prompts, completions):\n    return [0.0] * len(completions)\n")
    args = SimpleNamespace(
        dataset_name="trl-lib/tldr", reward_fn=("run=3/rewards.py:f",), eval_dataset_name="data/prompts.jsonl"
    )
    check_paths(args, "dataset_name", "reward_fn", "eval_dataset_name")
    assert args.dataset_name == "trl-lib/tldr" and args.reward_fn == ("run=3/rewards.py:f",)
    assert args.eval_dataset_name == os.path.join(REPO, "data", "prompts.jsonl")
    assert (
        "note: --eval_dataset_name 'data/prompts.jsonl' is not in the working directory: this repository's"
        in capsys.readouterr().out
    )
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mypairs.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit) as stop:
        check_paths(SimpleNamespace(dataset_name="data/mypairs"), "dataset_name")
    assert str(stop.value) == (
        "error: --dataset_name 'data/mypairs' does not exist (a local path, not a hub id) (did you mean 'data/mypairs.jsonl'?)"
    )
    (tmp_path / "mypairs.parquet").write_text("")  # (a name that could be a hub id, but a file beside it: that was meant)
    with pytest.raises(SystemExit) as stop:
        check_paths(SimpleNamespace(dataset_name="mypairs"), "dataset_name")
    assert str(stop.value).endswith("(did you mean 'mypairs.parquet'?)")
