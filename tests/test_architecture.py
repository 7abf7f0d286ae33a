"""The layering docs/architecture.md describes, checked on the source.

- No import cycles between parts of memstudy. A part is a subpackage (memstudy.meters, ...),
  a top-level module (memstudy.train, ...), or, inside memstudy.techniques, the registry
  (the package itself and base.py) apart from each technique module and compose.py: technique
  modules are plugins the registry loads by name, and they may use the harness below them.
  Every import counts, also those inside functions (a cycle hidden in a function is still a
  cycle); only `if TYPE_CHECKING:` blocks are left out.
- `import memstudy.config` loads neither torch nor cv2 (the grid parent and reports use it).
- No technique is named outside memstudy.techniques: the harness asks the plan for declared
  facts instead (the report's Tri-Accel section, which exists for one technique, excepted).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from memstudy.techniques import list_techniques

PACKAGE = Path(__file__).resolve().parents[1] / "memstudy"
# Modules allowed to name one technique, and why.
NAMES_ALLOWED = {
    "report/triaccel_section.py": "the report section of the tri_accel technique",
    "report/cost.py": "the report's accumulation section, about the accumulate technique",
    "tune.py": "'checkpoint' there is a key of the tune spec's [search] table (a file)",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """The part a module belongs to (see the module docstring)."""
    parts = module.split(".")
    if parts[:2] == ["memstudy", "techniques"]:
        return "memstudy.techniques" if len(parts) == 2 or parts[2] == "base" else ".".join(parts[:3])
    return ".".join(parts[:2])


def imported_modules(tree: ast.AST) -> list[str]:
    """memstudy modules imported anywhere in `tree`, except under `if TYPE_CHECKING:`."""
    skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
               and "TYPE_CHECKING" in ast.unparse(block.test) for node in ast.walk(block)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from memstudy.x import y` imports memstudy.x, and y if y is a module
            found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names
                      if _is_module(f"{node.module}.{a.name}")]
    return [m for m in found if m == "memstudy" or m.startswith("memstudy.")]


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def part_graph() -> dict[str, dict[str, set[str]]]:
    """part -> imported part -> the modules whose imports make that edge."""
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in PACKAGE.rglob("*.py"):
        source = module_name(path)
        for target in imported_modules(ast.parse(path.read_text())):
            a, b = part_of(source), part_of(target)
            if a != b and b != "memstudy":
                graph[a][b].add(f"{source} -> {target}")
    return graph


def find_cycle(graph: dict[str, dict[str, set[str]]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_parts_of_memstudy_import_each_other_without_cycles():
    graph = part_graph()
    cycle = find_cycle(graph)
    if cycle:
        edges = [sorted(graph[a][b])[0] for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle " + " -> ".join(cycle) + "\n  " + "\n  ".join(edges))


def test_the_cycle_check_finds_a_cycle_hidden_in_a_function():
    """The check itself: a function-level import that closes a loop is reported."""
    graph = part_graph()
    graph["memstudy.store"]["memstudy.runner"].add("memstudy.store -> memstudy.runner (test)")
    assert find_cycle(graph) is not None
    tree = ast.parse("def f():\n    from memstudy.runner import execute\n")
    assert imported_modules(tree) == ["memstudy.runner"]
    typed = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import memstudy.train\n")
    assert imported_modules(typed) == []


def test_importing_the_config_loads_neither_torch_nor_cv2():
    code = ("import sys, memstudy.config, memstudy.store, memstudy.typecheck; "
            "bad = {'torch', 'cv2'} & set(sys.modules); assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_no_technique_is_named_outside_the_registry():
    names = {t.name for t in list_techniques()}
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("techniques/") or rel in NAMES_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"memstudy/{rel}:{node.lineno} {node.value!r}")
    assert not found, "declare a fact on the Technique instead of naming it:\n" + "\n".join(found)
