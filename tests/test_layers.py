"""The package's layers import downwards only: no import cycle between orgel's parts.

Each subpackage (``orgel.graph``, ``orgel.split``, ...) and each module at the
package root is one part; an import of one part by another, at the top of a
module or inside a function, is an arrow. The arrows must form no cycle, so
that the layers read schedule → sim → costs → graph → split → launch (processes,
devices) → runtime → profile → plan → worker → the API. Inside a folder no two
modules import each other, even through others (an import under ``if
TYPE_CHECKING:`` never runs and does not count); the profiler and the planners do
not reach into the runtime; and a Plan is a value that nothing edits.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from orgel.schedule.families import build_schedule

ROOT = Path(__file__).resolve().parent.parent / "src" / "orgel"


def _part(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _arrows() -> dict[str, set[str]]:
    arrows: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        src = _part(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "orgel":
                names = [f"orgel.{a.name}" for a in node.names]  # from orgel import api
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                parts = name.split(".")
                if parts[0] == "orgel" and len(parts) > 1 and parts[1] != src:
                    arrows.setdefault(src, set()).add(parts[1])
    return arrows


def _cycle(arrows: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``arrows`` as a list of parts, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(part: str) -> list[str] | None:
        state[part] = 1
        stack.append(part)
        for nxt in sorted(arrows.get(part, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[part] = 2
        return None

    for part in sorted(arrows):
        if part not in state and (found := visit(part)):
            return found
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None


def test_no_part_of_orgel_imports_a_part_that_imports_it_back() -> None:
    arrows = _arrows()
    assert {"graph", "split", "runtime", "profile", "plan", "worker", "explicit", "transparent"} \
        <= set(arrows)
    assert _cycle(arrows) is None, " -> ".join(_cycle(arrows) or [])


# -- modules inside one folder ------------------------------------------------------------


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The imports of ``tree`` that run: at the top, in functions, not under TYPE_CHECKING."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return [n for n in ast.walk(tree)
            if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in skipped]


def _module_arrows() -> dict[str, set[str]]:
    """Module -> the orgel modules of its own folder it imports."""
    paths = {_module(p): p for p in ROOT.rglob("*.py")}
    arrows: dict[str, set[str]] = {}
    for name, path in paths.items():
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif node.module and not node.level:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths
                           else node.module for a in node.names]
            else:
                targets = []
            for t in targets:
                if t in paths and t != name and paths[t].parent == path.parent:
                    arrows.setdefault(name, set()).add(t)
    return arrows


def test_no_module_imports_a_module_of_its_folder_that_imports_it_back() -> None:
    arrows = _module_arrows()
    assert "orgel.plan.planner" in arrows  # the pass sees the imports
    assert _cycle(arrows) is None, " -> ".join(_cycle(arrows) or [])


#: The imports of the runtime below it, where the profiler times the runtime's own work:
#: its per-action overhead (its executor on an empty pipeline), and each block as a
#: compiled stage runs it (``compile=True``).
RUNTIME_MEASURED = {("profile/overhead.py", "orgel.runtime.executor"),
                    ("profile/compiled.py", "orgel.runtime.compiled")}


def test_the_profiler_and_the_planners_do_not_import_the_runtime() -> None:
    found = set()
    for part in ("profile", "plan"):
        for path in (ROOT / part).rglob("*.py"):
            for node in _runtime_imports(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""])
                found |= {(str(path.relative_to(ROOT)), n) for n in names
                          if n == "orgel.runtime" or n.startswith("orgel.runtime.")}
    assert found <= RUNTIME_MEASURED, sorted(found - RUNTIME_MEASURED)


def test_a_plan_is_frozen() -> None:
    plan = build_schedule("1f1b", 2, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.tp = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.meta = {}  # type: ignore[misc]
    changed = dataclasses.replace(plan, tp=2, meta={**plan.meta, "note": "x"})
    assert (plan.tp, changed.tp) == (1, 2) and "note" not in plan.meta
    assert changed.processes_of(1) == [2, 3]
    assert (changed.pipeline_rank_of(3), changed.tp_member_of(3)) == (1, 1)


def test_no_module_is_over_500_lines() -> None:
    """Files stay focused: a module over 500 lines is split by what its parts do."""
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these modules (lines): {long}"
