"""The layering docs/architecture.md describes, checked on the source.

- Import direction: every module has a layer in docs/architecture.md's table (read from the
  page), and imports only from its own layer and the layers below (every import counts, also
  those inside functions), except the listed KNOWN_UPWARD ones, each to be removed.
- No import cycles between parts of memstudy. A part is a subpackage (memstudy.meters, ...),
  a top-level module (memstudy.train, ...), or, inside memstudy.techniques, the registry
  (the package itself, base.py, _registry.py and options.py) apart from each technique
  module and compose.py: technique modules are plugins the registry loads by name, and they
  may use the harness below them.
  Every import counts, also those inside functions (a cycle hidden in a function is still a
  cycle); only `if TYPE_CHECKING:` blocks are left out.
- `import memstudy.config` loads neither torch nor cv2 (the grid parent and reports use it).
- No technique is named outside memstudy.techniques: the harness asks the plan for declared
  facts instead (the report's Tri-Accel section, which exists for one technique, excepted).
  Nor is a technique's module imported there (IMPORTS_ALLOWED: the Tri-Accel report section
  and tune's efficiency objective read the score from the technique's package).
"""
from __future__ import annotations

import ast
import fnmatch
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from memstudy.techniques import list_techniques

PACKAGE = Path(__file__).resolve().parents[1] / "memstudy"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
# Upward imports that are still there, each with what removes it. To be removed: the importing
# modules are being reworked elsewhere; nothing may be added to this list.
KNOWN_UPWARD: set[str] = set()  # none left
# Technique modules the harness still imports by name (the loop should ask the registry for
# declared facts: techniques.micro_batches / planned_steps). To be removed.
KNOWN_NAMED: set[str] = set()  # none left
# Imports of one technique's own modules from outside memstudy.techniques, and why.
IMPORTS_ALLOWED = {
    "memstudy.report.triaccel_section -> memstudy.techniques.tri_accel.score":
        "the report section of the tri_accel technique: its runs' control rows and score",
    "memstudy.report.triaccel_section -> memstudy.techniques.tri_accel.precision":
        "the report section of the tri_accel technique: the names of its precision tiers",
    "memstudy.tune -> memstudy.techniques.tri_accel.score":
        "tune's `efficiency_score` objective is Tri-Accel's efficiency score",
}
# Modules allowed to name one technique, and why.
NAMES_ALLOWED = {
    "report/triaccel_section.py": "the report section of the tri_accel technique",
    "report/cost.py": "the report's accumulation section, about the accumulate technique",
    "tune/__init__.py": "'checkpoint' there is a key of the tune spec's [search] table (a file)",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """The part a module belongs to (see the module docstring)."""
    parts = module.split(".")
    if parts[:2] == ["memstudy", "techniques"]:
        registry = len(parts) == 2 or parts[2] in ("base", "_registry", "options")
        return "memstudy.techniques" if registry else ".".join(parts[:3])
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


def layer_table(text: str) -> list[tuple[str, list[str]]]:
    """(layer, module patterns) from the page's `| layer | modules |` table, top layer first."""
    section = text.split("## Layers", 1)[1]
    rows = re.findall(r"^\| ([a-z ]+) \| (`.*`) \|$", section, flags=re.M)
    return [(name, re.findall(r"`([^`]+)`", modules)) for name, modules in rows]


def _pattern_module(pattern: str) -> tuple[str, bool]:
    """(module or glob, whether it covers the modules inside): `grid/` -> memstudy.grid and
    what is inside, `techniques/<name>.py` -> memstudy.techniques.* (a glob), `cli.py` and
    `techniques/__init__.py` -> that one module."""
    path = pattern.replace("<name>", "*").removesuffix(".py")
    inside = path.endswith("/")
    module = ".".join(["memstudy", *path.removesuffix("/").split("/")]).removesuffix(".__init__")
    return module, inside


def layer_of(module: str, table: list[tuple[str, list[str]]]) -> int | None:
    """Height of the module's layer (0 = the bottom one), by its most specific pattern: the
    module itself, then a folder holding it, then a glob."""
    best: tuple[int, int] | None = None  # (specificity, height)
    for height, (_, patterns) in enumerate(reversed(table)):
        for pattern in patterns:
            target, inside = _pattern_module(pattern)
            if module == target:
                rank = (2, height)
            elif inside and module.startswith(target + "."):
                rank = (1, height)
            elif "*" in target and fnmatch.fnmatchcase(module, target):
                rank = (0, height)
            else:
                continue
            best = max(best, rank) if best else rank
    return None if best is None else best[1]


def upward_imports(table) -> list[str]:
    found = []
    for path in PACKAGE.rglob("*.py"):
        source = module_name(path)
        for target in imported_modules(ast.parse(path.read_text())):
            low, high = layer_of(source, table), layer_of(target, table)
            if target != "memstudy" and high is not None and low is not None and high > low:
                found.append(f"{source} -> {target}")
    return sorted(set(found))


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


def module_graph() -> dict[str, dict[str, set[str]]]:
    """module -> imported module -> the edge, file by file (a package is its __init__)."""
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in PACKAGE.rglob("*.py"):
        source = module_name(path)
        for target in imported_modules(ast.parse(path.read_text())):
            if target not in (source, "memstudy"):
                graph[source][target].add(f"{source} -> {target}")
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


def test_every_module_has_a_layer():
    table = layer_table(ARCHITECTURE.read_text())
    assert [name for name, _ in table] == ["commands", "one run", "the loop", "plugins",
                                           "registry", "machinery", "settings"]
    missing = [module_name(p) for p in PACKAGE.rglob("*.py")
               if layer_of(module_name(p), table) is None]
    assert not missing, "give these modules a layer in docs/architecture.md: " + ", ".join(missing)


def test_layers_import_only_downward():
    upward = [edge for edge in upward_imports(layer_table(ARCHITECTURE.read_text()))
              if edge not in KNOWN_UPWARD]
    assert not upward, "imports from a higher layer (docs/architecture.md, Layers):\n" + \
        "\n".join(upward)


def test_the_known_upward_imports_are_still_there():
    """An exception that no longer happens is struck off the list."""
    edges = upward_imports(layer_table(ARCHITECTURE.read_text()))
    assert KNOWN_UPWARD <= set(edges), sorted(KNOWN_UPWARD - set(edges))


def test_the_direction_check_finds_an_upward_import_in_a_function(tmp_path):
    table = layer_table(ARCHITECTURE.read_text())
    assert layer_of("memstudy.config", table) < layer_of("memstudy.train", table)
    assert layer_of("memstudy.techniques.amp", table) > layer_of("memstudy.techniques", table)
    assert layer_of("memstudy.techniques.compose", table) == layer_of("memstudy.tiling.tiled_forward", table)
    tree = ast.parse("def f():\n    from memstudy.runner import execute\n")
    source, [target] = "memstudy.image_sizes", imported_modules(tree)
    assert layer_of(target, table) > layer_of(source, table)


def test_the_harness_imports_no_technique_module():
    """Only the registry's package loads technique modules (plugins); the rest asks the plan."""
    named = []
    for path in PACKAGE.rglob("*.py"):
        source = module_name(path)
        if source.startswith("memstudy.techniques"):
            continue
        for target in imported_modules(ast.parse(path.read_text())):
            parts = target.split(".")
            if parts[:2] == ["memstudy", "techniques"] and len(parts) > 2 \
                    and parts[2] not in ("base", "_registry", "compose"):
                named.append(f"{source} -> {target}")
    unexpected = sorted(set(named) - KNOWN_NAMED - set(IMPORTS_ALLOWED))
    assert not unexpected, "ask the plan or the registry for a declared fact instead:\n" + \
        "\n".join(unexpected)
    stale = sorted(set(IMPORTS_ALLOWED) - set(named))
    assert not stale, "strike these off IMPORTS_ALLOWED, they no longer happen: " + ", ".join(stale)


def test_parts_of_memstudy_import_each_other_without_cycles():
    graph = part_graph()
    cycle = find_cycle(graph)
    if cycle:
        edges = [sorted(graph[a][b])[0] for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle " + " -> ".join(cycle) + "\n  " + "\n  ".join(edges))


def test_no_two_modules_import_each_other_even_within_a_part():
    """File by file: grid/cells.py and grid/forkserver.py, or a package's __init__ and a module
    of it, may not import each other either (a private name taken across is the usual sign)."""
    cycle = find_cycle(module_graph())
    assert cycle is None, "import cycle between modules: " + " -> ".join(cycle)


def test_the_module_cycle_check_finds_two_siblings_importing_each_other():
    graph = module_graph()
    graph["memstudy.grid.history"]["memstudy.grid.spec"].add("test edge")
    assert find_cycle(graph) is not None  # grid.spec imports grid.history (plan_outcomes)


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


def _module_tree(text: str) -> str:
    """The fenced module tree at the top of docs/architecture.md."""
    return text.split("```", 2)[1]


def test_the_module_tree_names_every_module_and_package():
    """Every file and package directly under memstudy/ is named in the page's module tree
    (the tree is read by newcomers first: a module missing there is a module nobody finds)."""
    tree = _module_tree(ARCHITECTURE.read_text())
    names = [p.name + ("/" if p.is_dir() else "") for p in sorted(PACKAGE.iterdir())
             if (p.is_dir() and (p / "__init__.py").exists()) or
             (p.suffix == ".py" and p.name != "__init__.py")]
    missing = [n for n in names if not re.search(rf"(?<![\w/]){re.escape(n)}", tree)]
    assert not missing, "name these in docs/architecture.md's module tree: " + ", ".join(missing)
    entries = re.findall(r"^  ([a-z_]+(?:\.py|/))", tree, flags=re.MULTILINE)  # one per line
    stale = [n for n in entries if n not in names]
    assert not stale, "the module tree names modules that do not exist: " + ", ".join(stale)
