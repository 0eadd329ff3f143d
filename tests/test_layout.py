"""infra/ as a package: its modules import each other without a cycle, each opens with what it holds and stays short,
and the scripts reach it only through the surface infra/__init__.py lists."""

import ast
import os
import re

from conftest import REPO

INFRA = os.path.join(REPO, "infra")
SCRIPTS = "rloo.py grpo.py ppo.py distill.py rloo_tldr.py ppo_tldr.py sft.py reward.py dpo.py kto.py ilql.py raft.py".split()


def modules():
    return sorted(f[:-3] for f in os.listdir(INFRA) if f.endswith(".py") and f != "__init__.py")


def imports(module):
    """the infra modules a module imports (from .x import ..., or import infra.x)"""
    tree = ast.parse(open(os.path.join(INFRA, f"{module}.py")).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("infra."):
            found.add(node.module.split(".")[1])
    return found


def cycle(graph):
    """a cycle of the graph {node: {nodes}} as a list of nodes, or None"""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_infra_modules_import_without_cycles_open_with_a_docstring_and_stay_short():
    graph = {m: imports(m) for m in modules()}
    assert set().union(*graph.values()) <= set(graph)
    assert cycle(graph) is None, cycle(graph)
    for m in modules():
        text = open(os.path.join(INFRA, f"{m}.py")).read()
        assert ast.get_docstring(ast.parse(text)), f"infra/{m}.py opens with no docstring"
        assert len(text.splitlines()) <= 450, f"infra/{m}.py has {len(text.splitlines())} lines"


def test_the_scripts_use_the_surface_infra_lists():
    """each infra.NAME a script calls is in infra.__all__, and every name there is used by some script"""
    tree = ast.parse(open(os.path.join(INFRA, "__init__.py")).read())
    (listed,) = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "__all__"]
    used = set()
    for script in SCRIPTS:
        names = set(re.findall(r"\binfra\.(\w+)", open(os.path.join(REPO, script)).read()))
        assert names <= set(listed), f"{script} uses infra.{sorted(names - set(listed))}, not in infra/__init__.py"
        used |= names
    assert used == set(listed), f"infra/__init__.py lists {sorted(set(listed) - used)}, which no script uses"
