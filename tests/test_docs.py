"""The docs agree with the code: every flag a command in README.md or docs/ gives exists in the program it runs, every
flag a sentence names exists in one of them, and the suite's size and time the README gives are the suite's (and
docs/tests.md's)."""

import dataclasses
import glob
import importlib.util
import os
import re
import subprocess
import sys

from conftest import REPO

DOCS = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]
SCRIPTS = "rloo.py ppo.py grpo.py distill.py sft.py reward.py dpo.py kto.py rloo_tldr.py ppo_tldr.py".split()
COMMAND = re.compile(r"(?:python|accelerate launch)\s+((?:--?[\w-]+(?:\s+\w+)?\s+)*)(\S+\.py)\b([^`\n]*)")
FLAG = re.compile(r"(?<![\w-])--([a-z][\w-]*)")


def text(doc):
    with open(os.path.join(REPO, doc)) as f:
        return f.read().replace("\\\n", " ")  # (a command continued on the next line is one line)


def flags_of(program):
    """The flags a program of the repository takes: its tyro Args' fields (and --no_ for each switch), else every
    '--name' string its source holds (argparse's, or sys.argv's)"""
    with open(os.path.join(REPO, program)) as f:
        source = f.read()
    if "tyro.cli(Args" in source:
        spec = importlib.util.spec_from_file_location(f"docs_{program[:-3].replace('/', '_')}", os.path.join(REPO, program))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        names = {f.name for f in dataclasses.fields(module.Args)}
        return names | {"no_" + n for n in names} | {"help"}
    return set(re.findall(r"[\"']--([\w-]+)[\"']", source)) | {"help"}


def launcher_flags():
    from accelerate.commands.launch import launch_command_parser

    return {option.lstrip("-") for option in launch_command_parser()._option_string_actions}


def test_every_flag_the_docs_give_exists():
    """A command's flags (`python X.py --flag`) are X's, the launcher's before it (`accelerate launch --flag X.py`)
    accelerate's; a flag a sentence names is one of some program's (or TRL's that infra/argv.py reads).
    docs/experiments.md's commands run a script with the experiment's diff applied: the fields its diff adds count too."""
    from infra import argv

    programs, everything, wrong = {}, set(launcher_flags()) | {"no-deps"}, []
    with open(os.path.join(REPO, "docs", "experiments.md")) as f:
        added = set(re.findall(r"^\+\s+(\w+): \w", f.read(), re.M))
    for doc in DOCS:
        body = text(doc)
        for launcher, program, rest in COMMAND.findall(body):
            if not os.path.isfile(os.path.join(REPO, program)):
                continue
            programs.setdefault(program, flags_of(program))
            own = programs[program] | (added if doc == "docs/experiments.md" else set())
            wrong += [(doc, program, f) for f in FLAG.findall(rest) if f not in own]
            wrong += [(doc, "accelerate launch", f) for f in FLAG.findall(launcher) if f not in launcher_flags()]
    for program in SCRIPTS:
        programs.setdefault(program, flags_of(program))
    everything |= set().union(*programs.values()) | added
    everything |= set(argv.RENAMED) | set(argv.MODEL_KWARGS) | set(argv.ELSEWHERE)  # (TRL's, which the scripts read)
    for doc in DOCS:
        wrong += [(doc, "any program", f) for f in FLAG.findall(text(doc)) if f not in everything]
    assert not wrong, wrong
    assert {"rloo.py", "sft.py", "dpo.py", "tools/judge_tldr.py"} <= set(programs)  # (the commands were found)


def test_the_readme_gives_the_suites_size_and_docs_tests_md_its_time():
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    found = re.search(r"^(\d+) tests collected", collected.stdout, re.M)
    assert found, collected.stdout[-2000:] + collected.stderr[-2000:]
    count = int(found.group(1))
    readme, tests_md = text("README.md"), text("docs/tests.md")
    assert re.findall(r"\((\d+) tests\)", readme) == [str(count)], count
    minutes = re.findall(r"([\d.]+) minutes on idle cores", readme)
    assert minutes and re.findall(r"([\d.]+) minutes on idle cores", tests_md) == minutes
    assert re.findall(r"\((\d+) tests\)", tests_md) in ([], [str(count)])
