"""The package's layers import downwards only: no import cycle between orgel's parts.

Each subpackage (``orgel.graph``, ``orgel.split``, ...) and each module at the
package root is one part; an import of one part by another, at the top of a
module or inside a function, is an arrow. The arrows must form no cycle, so
that the layers read graph → split → runtime → profile → plan → the API.
"""

from __future__ import annotations

import ast
from pathlib import Path

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
