"""docs/experiments.md stays true: each experiment's diff applies to the shipped script it names (every hunk's old lines
stand in the script, in order), changes that one file, and leaves a script that compiles."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def diffs():
    text = open(os.path.join(REPO, "docs", "experiments.md")).read()
    return re.findall(r"```diff\n(.*?)```", text, re.S)


def apply(diff):
    """(the file the diff changes, its text with the diff applied); fails where a hunk's old lines are not in the file"""
    lines = diff.splitlines()
    (old,) = [line[len("--- a/") :] for line in lines if line.startswith("--- a/")]
    (new,) = [line[len("+++ b/") :] for line in lines if line.startswith("+++ b/")]
    assert old == new, f"the diff renames {old} to {new}"
    text = open(os.path.join(REPO, old)).read().splitlines()
    hunks, start = [], None
    for i, line in enumerate(lines):
        if line.startswith("@@"):
            if start is not None:
                hunks.append(lines[start:i])
            start = i + 1
    hunks.append(lines[start:])
    at = 0
    for hunk in hunks:
        before = [line[1:] for line in hunk if line[:1] in (" ", "-")]
        after = [line[1:] for line in hunk if line[:1] in (" ", "+")]
        found = next((j for j in range(at, len(text) - len(before) + 1) if text[j : j + len(before)] == before), None)
        assert found is not None, f"{old}: a hunk's lines are not in the script:\n" + "\n".join(before)
        text[found : found + len(before)] = after
        at = found + len(after)
    return old, "\n".join(text) + "\n"


def test_each_experiment_is_one_scripts_diff_that_applies():
    found = diffs()
    assert len(found) == 5
    for diff in found:
        script, text = apply(diff)
        assert script in ("rloo.py", "grpo.py"), script
        assert text != open(os.path.join(REPO, script)).read()
        compile(text, script, "exec")
