"""The blocks the scripts share verbatim, kept identical (transformers' check_copies, for single-file scripts).

A shared block is marked in every script that holds it:

    # copy: draw prompts
    ...
    # end copy

Blocks of one name must read the same (up to their indentation) in every script; the first script in SCRIPTS that
holds a name is its source. A copy may rename, as transformers' "Copied from ... with Bert->Roberta":
`# copy: policy and reference (model_name_or_path->sft_model_path)` is the source's block with every word
`model_name_or_path` read as `sft_model_path`.
`python tests/test_copies.py --fix` rewrites every copy from its source, as transformers' `make fix-copies`;
the test fails on any drift.
"""

import difflib
import itertools
import os
import re
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["rloo.py", "grpo.py", "ppo.py", "rloo_tldr.py", "ppo_tldr.py"]
START, END = re.compile(r"^(\s*)# copy: ([^(]+?)\s*(?:\((.*)\))?\s*$"), re.compile(r"^\s*# end copy\s*$")


def blocks(text, name=""):
    """{block name: (first line, last line, indent, renames)} of one script's marked blocks (the lines between the
    markers; a block may hold others); renames: [(old, new), ...]."""
    found, open_blocks = {}, []
    for i, line in enumerate(text.splitlines()):
        if START.match(line):
            indent, block, renames = START.match(line).groups()
            assert block not in found and block not in [b[0] for b in open_blocks], f"{name}:{i + 1}: a second {block!r}"
            renames = [tuple(r.strip().split("->")) for r in renames.split(",")] if renames else []
            open_blocks.append((block, i + 1, indent, renames))
        elif END.match(line):
            assert open_blocks, f"{name}:{i + 1}: '# end copy' without '# copy:'"
            block, first, indent, renames = open_blocks.pop()
            found[block] = (first, i, indent, renames)
    assert not open_blocks, f"{name}: copy block {open_blocks[-1][0]!r} is never closed"
    return found


def body(lines, first, last):
    return textwrap.dedent("\n".join(lines[first:last]))


def drifted(folder, fix=False):
    """The copies in folder's scripts that differ from their source, as 'script: block (source)' lines; with fix,
    rewritten from the source first (one at a time, outer blocks first, until none differs)."""
    out = []
    for _ in range(100):
        texts = {s: open(os.path.join(folder, s)).read() for s in SCRIPTS if os.path.exists(os.path.join(folder, s))}
        sources, found = {}, []
        for script, text in texts.items():
            lines = text.splitlines()
            for block, (first, last, _, renames) in sorted(blocks(text, script).items(), key=lambda b: b[1][0]):
                if block not in sources:
                    assert not renames, f"{script}: the source of block {block!r} renames nothing"
                    sources[block] = (script, body(lines, first, last))
                    continue
                source, expected = sources[block]
                for old, new in renames:
                    expected = re.sub(rf"\b{re.escape(old)}\b", new, expected)
                if body(lines, first, last) != expected:
                    found.append((script, block, source, first, last, expected))
        if not fix or not found:
            return out + [f"{script}: block {block!r} differs from {source}'s" for script, block, source, *_ in found]
        script, block, source, first, last, expected = found[0]
        out.append(f"{script}: block {block!r} differs from {source}'s")
        lines = texts[script].splitlines()
        # at the depth of the block's own lines (the marker may sit deeper than some of them)
        depth = min(len(x) - len(x.lstrip()) for x in lines[first:last] if x.strip())
        lines[first:last] = textwrap.indent(expected, " " * depth).split("\n")  # a trailing blank line kept
        with open(os.path.join(folder, script), "w") as f:
            f.write("\n".join(lines) + "\n")
    raise AssertionError("--fix does not converge")


def unmarked_runs(folder, length=20):
    """Runs of `length` or more identical lines (blank ones skipped) that two scripts share outside their marked
    blocks and their imports, as 'a:line ~ b:line (n lines)'."""
    kept = {}
    for script in SCRIPTS:
        text = open(os.path.join(folder, script)).read()
        inside = set()
        for first, last, _, _ in blocks(text, script).values():
            inside |= set(range(first - 1, last + 1))
        lines = text.splitlines()
        start = next(i for i, x in enumerate(lines) if x.startswith(("@", "def ", "class ", "PROMPTS", "ALGORITHM")))
        kept[script] = [(i + 1, x.strip()) for i, x in enumerate(lines) if i >= start and i not in inside and x.strip()]
    out = []
    for a, b in itertools.combinations(SCRIPTS, 2):
        matcher = difflib.SequenceMatcher(None, [x for _, x in kept[a]], [x for _, x in kept[b]], autojunk=False)
        for m in matcher.get_matching_blocks():
            if m.size >= length:
                out.append(f"{a}:{kept[a][m.a][0]} ~ {b}:{kept[b][m.b][0]} ({m.size} lines)")
    return out


def test_marked_copies_match_their_source():
    assert drifted(REPO) == []


def test_no_unmarked_copy_of_20_lines():
    """What two scripts share verbatim is marked (and so checked): no run of 20 identical lines is left unmarked."""
    assert unmarked_runs(REPO) == []


def test_every_script_shares_the_common_blocks():
    """Each script marks the blocks that every script runs (so that none can drift unseen); the plumbing they share is
    called from infra.py instead."""
    common = {"draw prompts", "rows, sampling and scoring", "rollout masks", "a chunk of the rollout"}
    common |= {"gather the rollout", "log the update", "write the metrics"}
    for script in SCRIPTS:
        assert common <= set(blocks(open(os.path.join(REPO, script)).read(), script)), script


def test_an_edited_copy_is_found_and_fixed(tmp_path):
    for script in SCRIPTS:
        with open(os.path.join(REPO, script)) as f:
            (tmp_path / script).write_text(f.read())
    text = (tmp_path / "grpo.py").read_text()
    first, last, _, _ = blocks(text)["write the metrics"]
    lines = text.splitlines()
    lines[first + 2] += "  # an edit in one copy"
    (tmp_path / "grpo.py").write_text("\n".join(lines) + "\n")
    assert drifted(tmp_path) == ["grpo.py: block 'write the metrics' differs from rloo.py's"]
    drifted(tmp_path, fix=True)
    assert drifted(tmp_path) == [] and (tmp_path / "grpo.py").read_text() == open(os.path.join(REPO, "grpo.py")).read()


if __name__ == "__main__":
    problems = drifted(REPO, fix="--fix" in sys.argv)
    print("\n".join(problems) or "every marked copy matches its source")
    sys.exit(1 if problems and "--fix" not in sys.argv else 0)
