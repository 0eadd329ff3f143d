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
