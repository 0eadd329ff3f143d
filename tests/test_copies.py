"""Functions the scripts share verbatim, kept identical the way transformers keeps its copies (utils/check_copies.py).

A TL;DR script holds its base script's functions (its algorithm, and its main) as copies, each marked on the line
above it with the function it copies:

    # Copied from rloo.rloo_advantages
    def rloo_advantages(rlhf_reward, k, scored):

A copy may rename, as transformers' "Copied from ... with Bert->Roberta": `# Copied from ppo.main with eos->after_eos`
is the source with every word `eos` read as `after_eos`. Whole functions (or classes) only, no end markers, no
nesting, at most five copies per script. `python tests/test_copies.py --fix` rewrites every copy from its source, as
transformers' `make fix-copies`; the test fails on any drift. Plumbing is never copied: it is a call into infra/
"""

import ast
import difflib
import itertools
import os
import re
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["rloo.py", "grpo.py", "ppo.py", "rloo_tldr.py", "ppo_tldr.py", "distill.py"]
MARK = re.compile(r"^# Copied from (\w+)\.([\w.]+)(?: with (.*))?$")


def definitions(text):
    """{name: (first line, last line)} of a module's top-level functions and classes (0-based, the decorators
    included), and of their methods as "Class.method"."""
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
            out[node.name] = (first, node.end_lineno)
            for child in node.body if isinstance(node, ast.ClassDef) else []:
                if isinstance(child, ast.FunctionDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)]) - 1
                    out[f"{node.name}.{child.name}"] = (first, child.end_lineno)
    return out


def copies(folder, script):
    """The marked copies of a script: (source module, source name, renames [(old, new)], the copy's first and last
    line) each, the copy being the definition right below its mark."""
    text = open(os.path.join(folder, script)).read()
    lines, defs = text.splitlines(), definitions(text)
    starts = {first: (name, last) for name, (first, last) in defs.items()}
    out = []
    for i, line in enumerate(lines):
        match = MARK.match(line)
        if match:
            module, name, renames = match.groups()
            assert i + 1 in starts, f"{script}:{i + 1}: '# Copied from' is not right above a function or class"
            renames = [tuple(r.strip().split("->")) for r in renames.split(",")] if renames else []
            out.append((module, name, renames, i + 1, starts[i + 1][1]))
    return out


def source_text(folder, module, name):
    path = os.path.join(folder, f"{module}.py")
    text = open(path).read()
    first, last = definitions(text)[name]
    return textwrap.dedent("\n".join(text.splitlines()[first:last]))


def drifted(folder, fix=False):
    """The copies in folder's scripts that differ from their source, as 'script: NAME differs from module.NAME' lines;
    with fix, rewritten from the source first."""
    out = []
    for script in SCRIPTS:
        if not os.path.exists(os.path.join(folder, script)):
            continue
        # bottom up, so that a rewritten copy does not move the ones above it
        for module, name, renames, first, last in reversed(copies(folder, script)):
            assert f"{module}.py" != script, f"{script}: {name} is marked as a copy of itself"
            expected = source_text(folder, module, name)
            for old, new in renames:
                expected = re.sub(rf"\b{re.escape(old)}\b", new, expected)
            lines = open(os.path.join(folder, script)).read().splitlines()
            indent = len(lines[first]) - len(lines[first].lstrip())
            if textwrap.dedent("\n".join(lines[first:last])) == expected:
                continue
            out.append(f"{script}: {name} differs from {module}.{name}")
            if fix:
                lines[first:last] = textwrap.indent(expected, " " * indent).split("\n")
                with open(os.path.join(folder, script), "w") as f:
                    f.write("\n".join(lines) + "\n")
    return out


def unmarked_runs(folder, length=20):
    """Runs of `length` or more identical lines (blank ones skipped) that two scripts share outside their marked
    copies and above their first definition (the docstring and imports), as 'a:line ~ b:line (n lines)'."""
    kept = {}
    for script in SCRIPTS:
        text = open(os.path.join(folder, script)).read()
        inside = set()
        for *_, first, last in copies(folder, script):
            inside |= set(range(first - 1, last))
        lines = text.splitlines()
        start = next(i for i, x in enumerate(lines) if x.startswith(("@", "def ", "class ")))
        kept[script] = [(i + 1, x.strip()) for i, x in enumerate(lines) if i >= start and i not in inside and x.strip()]
    out = []
    for a, b in itertools.combinations(SCRIPTS, 2):
        matcher = difflib.SequenceMatcher(None, [x for _, x in kept[a]], [x for _, x in kept[b]], autojunk=False)
        for m in matcher.get_matching_blocks():
            if m.size >= length:
                out.append(f"{a}:{kept[a][m.a][0]} ~ {b}:{kept[b][m.b][0]} ({m.size} lines)")
    return out


def test_copies_match_their_source():
    assert drifted(REPO) == []


def test_no_unmarked_copy_of_20_lines():
    """What two scripts share verbatim is marked (and so checked): no run of 20 identical lines is left unmarked."""
    assert unmarked_runs(REPO) == []


def test_each_tldr_script_copies_its_base_and_at_most_five_functions():
    """A TL;DR script copies its base's flags (a class) and main, with at most five functions in all; the base
    scripts (and distill.py) copy nothing."""
    named = {script: [name for _, name, *_ in copies(REPO, script)] for script in SCRIPTS}
    assert named["rloo.py"] == named["grpo.py"] == named["ppo.py"] == named["distill.py"] == []
    assert named["rloo_tldr.py"] == ["RLOOArgs", "rloo_advantages", "trl_names", "main"]
    assert named["ppo_tldr.py"][0] == "PPOArgs" and "main" in named["ppo_tldr.py"] and len(named["ppo_tldr.py"]) - 1 <= 5


def test_an_edited_copy_is_found_and_fixed(tmp_path):
    for script in SCRIPTS:
        with open(os.path.join(REPO, script)) as f:
            (tmp_path / script).write_text(f.read())
    text = (tmp_path / "rloo_tldr.py").read_text()
    first, last = definitions(text)["main"]
    lines = text.splitlines()
    lines[first + 3] += "  # an edit in the copy"
    (tmp_path / "rloo_tldr.py").write_text("\n".join(lines) + "\n")
    assert drifted(tmp_path) == ["rloo_tldr.py: main differs from rloo.main"]
    drifted(tmp_path, fix=True)
    assert (
        drifted(tmp_path) == [] and (tmp_path / "rloo_tldr.py").read_text() == open(os.path.join(REPO, "rloo_tldr.py")).read()
    )
    # a rename: the copy reads every word `old` of the source as `new`
    text = (tmp_path / "rloo_tldr.py").read_text().replace("# Copied from rloo.main", "# Copied from rloo.main with k->group")
    (tmp_path / "rloo_tldr.py").write_text(text)
    drifted(tmp_path, fix=True)
    fixed = (tmp_path / "rloo_tldr.py").read_text()
    assert "group = args.rloo_k  # completions per prompt" in fixed and drifted(tmp_path) == []


if __name__ == "__main__":
    problems = drifted(REPO, fix="--fix" in sys.argv)
    print("\n".join(problems) or "every marked copy matches its source")
    sys.exit(1 if problems and "--fix" not in sys.argv else 0)
