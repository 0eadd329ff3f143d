"""TRL's command lines as the scripts' parser (tyro) takes them: HfArgumentParser's boolean values, the flags of TRL
(and of transformers' TrainingArguments) that the scripts hold under another name, and, for any flag a script does not
have, one line naming it and, where the scripts do its work another way, the flag that does; a value the parser refuses,
one line too (tyro's message without its box).
"""

import contextlib
import dataclasses
import io
import json
import re
import sys
import typing

from utils import Stopped, die

BOOLEANS = {"true": True, "t": True, "yes": True, "y": True, "1": True, "false": False, "f": False, "no": False, "n": False,
            "0": False}  # fmt: skip

# TRL's name -> ours, the same meaning
RENAMED = {
    "run_name": "exp_name",
    "dataset_train_split": "dataset_split",
    "save_total_limit": "keep_checkpoints",
    "per_device_eval_batch_size": "eval_batch_size",
}
# TRL's model flags (its ModelConfig) -> a keyword of from_pretrained, which --model_init_kwargs holds
MODEL_KWARGS = {"dtype": "dtype", "torch_dtype": "dtype", "attn_implementation": "attn_implementation",
                "model_revision": "revision"}  # fmt: skip
# flags of TRL's whose work the scripts do another way: what to use instead
ELSEWHERE = {
    "max_steps": "--total_episodes: the completions (or examples) in all, updates times the batch",
    "num_train_epochs": "--total_episodes: the completions in all",
    "logging_steps": "every update is logged",
    "logging_strategy": "every update is logged",
    "save_steps": "--checkpoint_every, in updates",
    "save_strategy": "--checkpoint_every, in updates",
    "eval_steps": "--eval_every, in episodes (examples)",
    "eval_strategy": "--eval_dataset_name and --eval_every",
    "resume_from_checkpoint": "--resume, from the newest checkpoint in --output_dir",
    "dataset_test_split": "--eval_dataset_name (the same dataset) and --eval_split",
    "lr_scheduler_kwargs": "--min_lr_rate",
    "gradient_checkpointing_kwargs": "--gradient_checkpointing runs non-reentrant",
    "fp16": "--bf16",
    "vllm_mode": "--use_vllm, in the training process (TRL's colocate mode)",
    "disable_dropout": "no dropout is ever run",
    "report_to": "--track for wandb; TensorBoard is always written",
}
# older TRL names of a flag the offline scripts hold as TRL 1.16 does, for the line that refuses them
RETIRED = {
    "max_seq_length": "--max_length, TRL 1.16's name",
    "max_prompt_length": "--max_length, the prompt and completion together, as TRL 1.16's",
    "max_completion_length": "--max_length, the prompt and completion together, as TRL 1.16's",
}
# flags a script takes under TRL's name and ours, one setting the other: given both, the run stops in one line
PAIRS = [("max_completion_length", "response_length"), ("num_generations_eval", "num_eval_generations"),
         ("max_tool_calling_iterations", "max_turns"), ("chat_template_path", "chat_template"), ("num_generations", "rloo_k"),
         ("beta", "kl_coef"), ("epsilon", "cliprange"), ("num_iterations", "num_ppo_epochs"),
         ("steps_per_generation", "num_mini_batches"), ("generation_batch_size", "num_mini_batches"),
         ("steps_per_generation", "generation_batch_size"),
         ("vllm_importance_sampling_cap", "vllm_importance_sampling_clip_max")]  # fmt: skip
# TRL's values (a flag alone: the empty set) that say what the scripts always do, left out
ALWAYS = {
    "vllm_mode": [{"colocate"}],
    "disable_dropout": [set()] + [{word} for word, on in BOOLEANS.items() if on],
    "fp16": [{word} for word, on in BOOLEANS.items() if not on],
}


def trl_argv(cls, argv=None):
    """The command line (sys.argv's) as tyro parses cls: TRL's boolean values (HfArgumentParser's: true/false, yes/no,
    1/0, any case): of cls's switches, `--packing True` or `--bf16=false` as tyro's `--packing` and `--no_bf16`; of a
    field that takes a bool among other values (Optional[bool]), `--completion_only_loss false` as tyro's `False`.
    TRL's names: RENAMED's as ours, MODEL_KWARGS' into --model_init_kwargs, --report_to wandb as --track, and TRL's
    values that say what the scripts always do (ALWAYS, --report_to none) left out.
    A flag cls lacks stops the run in one line, with what to use instead where the scripts do its work (ELSEWHERE), and
    so do both names of one setting (PAIRS), and a value tyro refuses (checked)."""
    hints = typing.get_type_hints(cls)
    fields = {field.name for field in dataclasses.fields(cls)}
    switches = {name for name in fields if hints.get(name) is bool}
    valued = {name for name in fields - switches if bool in typing.get_args(hints.get(name))}  # (not a ClassVar)
    known = fields | {f"no_{name}" for name in switches} | {"help"}
    argv, out, kwargs, unknown, given = list(sys.argv[1:] if argv is None else argv), [], {}, [], set()
    own = None  # --model_init_kwargs' own JSON, which TRL's model flags join
    while argv:
        arg = argv.pop(0)
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        name = name.replace("-", "_")  # (both parsers take --use-peft too)
        given.add(name.removeprefix("no_") if name.removeprefix("no_") in switches else name)
        if name == "model_init_kwargs" and "model_init_kwargs" in fields:
            own = value if eq else argv.pop(0) if argv else ""
            continue
        if name in RENAMED and name not in fields and RENAMED[name] in fields:
            name, arg = RENAMED[name], f"--{RENAMED[name]}" + (f"={value}" if eq else "")
        if name in switches | valued and not eq and argv and argv[0].lower() in BOOLEANS:
            value = argv.pop(0)
        if name in switches and value.lower() in BOOLEANS:
            arg = f"--{'' if BOOLEANS[value.lower()] else 'no_'}{name}"
        elif name in valued and value.lower() in BOOLEANS:
            arg = f"--{name}={BOOLEANS[value.lower()]}"
        elif name and name not in known:  # (its values: after its `=`, or the words up to the next flag)
            taken = [value] if eq else []
            while not eq and argv and not argv[0].startswith("--"):
                taken.append(argv.pop(0))
            said = {v.lower() for v in taken}
            if name in MODEL_KWARGS and "model_init_kwargs" in fields and len(taken) == 1:
                kwargs[MODEL_KWARGS[name]] = taken[0]
            elif name == "report_to" and "track" in fields and said <= {"wandb", "all", "none", "tensorboard"}:
                out += ["--track"] if said & {"wandb", "all"} else []
            elif said not in ALWAYS.get(name, []):
                where = ELSEWHERE.get(name) or (RETIRED[name] if name in RETIRED and "max_length" in fields else None)
                unknown.append(f"--{name}" + (f" (TRL's; here {where})" if where else ""))
            continue
        out.append(arg)
    for trl, ours in PAIRS:
        if {trl, ours} <= given & fields:
            die(f"--{trl} and --{ours} set one thing (TRL's name and this script's): give one of them")
    if unknown:
        die(f"unknown flag{'s' if len(unknown) > 1 else ''} {'; '.join(unknown)}: --help lists the script's flags")
    if kwargs:  # (TRL's model flags beside --model_init_kwargs' own keywords, which win)
        try:
            theirs = json.loads(own or "{}")
        except json.JSONDecodeError:
            theirs = None
        if not isinstance(theirs, dict):
            die(f"--model_init_kwargs must be a JSON object ('{{\"name\": value, ...}}'), got {own}")
        own = json.dumps(kwargs | theirs)
    if own is not None:
        out += ["--model_init_kwargs", own]
    return checked(cls, out)


def checked(cls, argv):
    """argv, once tyro takes it for cls: a value it refuses (a dozen lines: the message in a box, the flag's help) stops
    the run in one line, the message and the flag's usage. A trial parse with its output held back (the script's own
    parse, after, prints any notes); --help is left to the script's."""
    import tyro

    if {"-h", "--help"} & set(argv):
        return argv
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            tyro.cli(cls, args=argv, use_underscores=True)
    except Stopped:  # a check's own line (utils.die), and the notes before it, as they were
        print(out.getvalue(), end="", flush=True)
        print(err.getvalue(), end="", file=sys.stderr, flush=True)
        raise
    except SystemExit:
        die(unboxed(err.getvalue() or out.getvalue()))
    return argv


def unboxed(text):
    """tyro's error (a title, the message, the flag's help, each part ruled off; in a box on a terminal) as one line:
    the message, with the usage of the flag it names where the help shows it"""
    parts, part = [], []
    for line in text.splitlines() + [""]:
        line = line.strip().strip("\u2502\u256d\u256e\u2570\u256f").strip()
        if line.startswith("\u2500 "):  # a box's top border, the title in it: a part of its own
            parts.append([line.strip("\u2500 ")])
        elif line and not set(line) <= {"\u2500", "-"}:
            part.append(line)
        elif part:
            parts.append(part)
            part = []
    if len(parts) < 2:
        return " ".join(text.split())
    message = re.sub(r"\[/?bold\]", "", " ".join(parts[1])).removeprefix("Error parsing ")
    message = message[:1].lower() + message[1:]
    usage = next((p[1] for p in parts[2:] if p[0] == "Argument helptext:" and len(p) > 1), "")
    flag = usage.split(" ")[0]
    if flag.startswith("--") and message.startswith(f"{flag}:"):  # "--flag: why" as "--flag TYPE: why"
        message = usage + message[len(flag) :]
    return f"{message} (--help lists the script's flags)"
