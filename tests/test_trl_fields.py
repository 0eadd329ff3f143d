"""Every field of TRL 1.16's GRPOConfig, RLOOConfig, DistillationConfig, DPOConfig, KTOConfig, RewardConfig and
SFTConfig beyond transformers' TrainingArguments is a flag of grpo.py, rloo.py, distill.py, dpo.py, kto.py, reward.py
or sft.py by TRL's name, or is listed in docs/flags.md under "TRL's options not offered"; and nothing listed there is
a flag. Computed from TRL's dataclasses where TRL is installed (it is not a requirement)."""

import dataclasses
import os
import re
import sys

import pytest
from conftest import REPO

sys.path.insert(0, REPO)


def not_offered(script):
    """The TRL fields the table in docs/flags.md names (each in backticks in its first column) for the script: a row
    whose first column names scripts, "(distill.py)" or "(dpo.py, kto.py)", is theirs only"""
    with open(os.path.join(REPO, "docs", "flags.md")) as f:
        section = f.read().split("## TRL's options not offered", 1)[1]
    names = set()
    for line in section.splitlines():
        first = line.split(" | ")[0]
        only = [name for paren in re.findall(r"\(([^)]*\.py)\)", first) for name in re.findall(r"(\w+)\.py", paren)]
        if line.startswith("| `") and (not only or script in only):
            names |= set(re.findall(r"`([a-z_0-9]+)(?:=[^`]*)?`", first))
    return names


@pytest.mark.parametrize(
    "script, config",
    [("grpo", "GRPOConfig"), ("rloo", "RLOOConfig"), ("distill", "DistillationConfig")]
    + [("dpo", "DPOConfig"), ("kto", "KTOConfig"), ("reward", "RewardConfig"), ("sft", "SFTConfig")],
)
def test_every_trl_field_is_a_flag_or_said_not_offered(script, config):
    trl = pytest.importorskip("trl")
    from transformers import TrainingArguments

    cls = getattr(trl, config, None)
    if cls is None:  # (DistillationConfig: TRL's experimental trainers)
        cls = getattr(pytest.importorskip("trl.experimental.distillation"), config)
    module = __import__(script)
    ours = {f.name for f in dataclasses.fields(module.Args)}
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    theirs = {f.name for f in dataclasses.fields(cls)} - base
    listed = not_offered(script)
    assert sorted(theirs - ours - listed) == [], f"{config}: neither a flag of {script}.py nor listed as not offered"
    assert sorted(listed & ours) == [], "listed as not offered in docs/flags.md, yet a flag"
    assert len(theirs) > 10  # (TRL's fields were read)


def test_trls_values_of_a_switch_set_it_as_tyros_switches_do(run, tmp_path):
    """HfArgumentParser's `--packing True`, `--bf16=false` (and yes/no, 1/0, any case, --use-peft): a switch set as
    tyro's `--packing` and `--no_bf16` set it; a field that takes a bool among other values takes them too
    (--completion_only_loss false, --scale_rewards false); and a script parses them as a user types them (its next
    check is the one that stops it)"""
    import tyro

    import grpo
    import infra
    import sft

    def parsed(module, argv):
        return tyro.cli(module.Args, args=infra.trl_argv(module.Args, argv), use_underscores=True)

    args = parsed(sft, ["--packing", "True", "--bf16=false", "--use_peft", "--assistant_only_loss", "yes"])
    assert (args.packing, args.bf16, args.use_peft, args.assistant_only_loss) == (True, False, True, True)
    args = parsed(sft, ["--packing=0", "--completion_only_loss", "false", "--no_use_peft", "--bf16", "--seed", "1"])
    assert (args.packing, args.completion_only_loss, args.use_peft, args.bf16, args.seed) == (False, False, False, True, 1)
    args = parsed(sft, ["--use-peft", "TRUE", "--completion_only_loss", "None"])
    assert args.use_peft is True and args.completion_only_loss is None
    args = parsed(grpo, ["--scale_rewards", "false", "--shuffle_dataset", "False"])
    assert args.scale_rewards is False and args.shuffle_dataset is False  # (grpo.py's main makes False none)
    proc = run("grpo.py --shuffle_dataset False --num_generations 1", cwd=tmp_path)
    assert proc.stderr.strip().splitlines()[-1] == "error: --num_generations must be at least 2, got 1"


def test_trls_names_run_as_ours_and_a_flag_a_script_lacks_is_one_line(run, tmp_path):
    """infra/argv.py: TRL's names of our flags (--run_name, --dataset_train_split, ...) parse as ours, its model flags
    join --model_init_kwargs (whose own keys win), --report_to wandb is --track, and values that say what the scripts
    do anyway are left out; any other flag a script lacks stops it in one line naming what does its work, nothing run"""
    import json

    import tyro

    import infra
    import rloo
    import sft

    def parsed(module, argv):
        return tyro.cli(module.Args, args=infra.trl_argv(module.Args, argv), use_underscores=True)

    argv = ["--run_name", "x", "--dataset_train_split=dev", "--save_total_limit", "3", "--per_device_eval_batch_size", "5"]
    argv += ["--report_to", "wandb", "--vllm_mode", "colocate", "--disable_dropout", "--fp16", "false", "--dtype", "bfloat16"]
    argv += ["--model_init_kwargs", '{"revision": "main", "dtype": "float32"}', "--attn_implementation=eager"]
    args = parsed(rloo, argv)
    assert (args.exp_name, args.dataset_split, args.keep_checkpoints, args.eval_batch_size) == ("x", "dev", 3, 5)
    assert args.track is True
    assert json.loads(args.model_init_kwargs) == {"dtype": "float32", "attn_implementation": "eager", "revision": "main"}
    args = parsed(rloo, ['--model-init-kwargs={"revision": "x"}', "--torch_dtype", "bfloat16"])  # (the = form, hyphens)
    assert json.loads(args.model_init_kwargs) == {"dtype": "bfloat16", "revision": "x"}
    args = parsed(sft, ["--report_to", "none", "--torch_dtype", "bfloat16", "--disable_dropout", "True"])
    assert args.track is False and json.loads(args.model_init_kwargs) == {"dtype": "bfloat16"}
    assert parsed(sft, ["--num_train_epochs", "2"]).num_train_epochs == 2  # (sft.py's own flag)

    proc = run(f"rloo.py --max_steps 3 --logging_steps 1 --disable_dropout false --output_dir {tmp_path / 'out'}", tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
    assert proc.stderr.strip().splitlines() == [
        "error: unknown flags --max_steps (TRL's; here --total_episodes: the completions (or examples) in all, updates"
        " times the batch); --logging_steps (TRL's; here every update is logged); --disable_dropout (TRL's; here no"
        " dropout is ever run): --help lists the script's flags"
    ]
    proc = run("sft.py --no_such_flag 1", tmp_path)
    assert proc.stderr.strip().splitlines() == ["error: unknown flag --no_such_flag: --help lists the script's flags"]
    with pytest.raises(SystemExit) as stop:  # an older TRL name of a flag sft.py holds as TRL 1.16 does; rloo.py has none
        infra.trl_argv(sft.Args, ["--max_seq_length", "64"])
    assert "--max_seq_length (TRL's; here --max_length, TRL 1.16's name)" in str(stop.value)
    with pytest.raises(SystemExit) as stop:
        infra.trl_argv(rloo.Args, ["--max_seq_length", "64"])
    assert str(stop.value) == "error: unknown flag --max_seq_length: --help lists the script's flags"
    # TRL's name and ours of one setting, both given: which would win is not the user's to guess
    proc = run("rloo.py --num_generations 4 --rloo_k=2", tmp_path)
    assert proc.stderr.strip().splitlines() == [
        "error: --num_generations and --rloo_k set one thing (TRL's name and this script's): give one of them"
    ]


def test_a_value_the_parser_refuses_is_one_line(run, tmp_path, capsys):
    """infra/argv.checked: a value tyro refuses (its dozen-line box: the message, the flag's help) stops the run in
    one line, the message with the flag's usage, before any work; a check's own line (utils.die) and --help as they
    were; tyro's box, as drawn on a terminal, read the same way (unboxed)"""
    import grpo
    import infra
    import rloo
    from infra.argv import unboxed
    from utils import Stopped

    def refused(module, argv):
        with pytest.raises(Stopped) as stop:
            infra.trl_argv(module.Args, argv)
        shown = capsys.readouterr()
        assert "helptext" not in shown.out + shown.err  # (tyro's box: held back)
        return str(stop.value)

    why = "(--help lists the script's flags)"
    assert refused(rloo, ["--rloo_k", "abc"]) == f"error: --rloo_k INT: invalid literal for int() with base 10: 'abc' {why}"
    line = refused(rloo, ["--learning_rate=x"])
    assert line == f"error: --learning_rate FLOAT: could not convert string to float: 'x' {why}"
    assert refused(grpo, ["--loss_type", "foo"]).startswith("error: invalid choice 'foo' for argument '--loss_type'.")
    assert refused(rloo, ["--rloo_k"]) == f"error: missing value for argument '--rloo_k'. Expected 1 values. {why}"
    assert refused(rloo, ["--temperature", "0"]) == "error: --temperature must be positive, got 0.0"
    assert infra.trl_argv(rloo.Args, ["--rloo_k", "3", "--help"]) == ["--rloo_k", "3", "--help"]
    box = """╭─ Value error ──────────────────────────────────────╮
│ Error parsing --rloo_k: invalid literal for int()  │
│ with base 10: 'abc'                                │
│ ────────────────────────────────────────────────── │
│ Argument helptext:                                 │
│     --rloo_k INT                                   │
│     the number of completions sampled per prompt   │
│ ────────────────────────────────────────────────── │
│ For full helptext, see rloo.py --help              │
╰────────────────────────────────────────────────────╯"""
    assert unboxed(box) == f"--rloo_k INT: invalid literal for int() with base 10: 'abc' {why}"

    proc = run(f"rloo.py --kl_estimator k9 --output_dir {tmp_path / 'out'}", tmp_path)
    assert proc.returncode == 2 and not (tmp_path / "out").exists()
    assert proc.stderr.strip().splitlines() == [
        f"error: invalid choice 'k9' for argument '--kl_estimator'. Expected one of ('k1', 'k2', 'k3', 'abs', 'full'). {why}"
    ]
