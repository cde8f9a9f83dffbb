"""The documentation cannot rot: its Python examples run, and the site builds strictly.

Every fenced ``python`` block in README.md and docs/*.md is run, the blocks of one file in
order in one namespace (a later block may use what an earlier one defined), in a
temporary working directory, on the small shapes the examples use. A block that is not
meant to run (a fragment naming the reader's own model, a snippet for torchrun) carries
the HTML comment ``<!-- no-run -->`` on the line before its fence; it is still compiled,
so its syntax cannot rot either. A file whose runnable blocks start ranks
(``orgel.pipeline``, ``orgel.backend``, ``orgel.load``) is a slow test.

``mkdocs build --strict`` (a broken link, a missing anchor or API reference fails) runs
when mkdocs is installed (the ``docs`` extra: ``pip install -e ".[dev,docs]"``). The README's
links, the file formats the docs show and the ``orgel simulate`` lines with their step
times are checked too.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NO_RUN = "<!-- no-run -->"
# the calls that start ranks: a file running one of them is a slow test
STARTS_RANKS = re.compile(r"orgel\.(pipeline|backend|load)\(")
_FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^`]*)$")


@dataclass
class Block:
    """One fenced code block: where it is, its language, whether it runs, its code."""

    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    runs: bool
    code: str


def code_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, in order."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        indent, info = len(match["indent"]), match["info"].strip()
        previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()),
                        "")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            body.append(lines[j][indent:])
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: a code block that is never closed")
        language = info.split()[0] if info else ""
        blocks.append(Block(path, i + 1, language, previous != NO_RUN, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: Path) -> list[Block]:
    return [b for b in code_blocks(path) if b.language == "python"]


def _page_params() -> list[object]:
    params = []
    for path in documents():
        runnable = [b for b in python_blocks(path) if b.runs]
        if not runnable:
            continue
        slow = any(STARTS_RANKS.search(b.code) for b in runnable)
        marks = [pytest.mark.slow] if slow else []
        params.append(pytest.param(path, marks=marks, id=str(path.relative_to(ROOT))))
    return params


@pytest.mark.parametrize("path", _page_params())
def test_examples_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every runnable Python block of the file runs, in order, in one namespace."""
    import torch

    # as in a fresh process: Dynamo remembers the shapes earlier tests compiled the same
    # code with (nn.Sequential's forward) and would trace the examples with dynamic shapes
    torch._dynamo.reset()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ORGEL_CACHE", str(tmp_path / "cache"))
    namespace: dict[str, object] = {"__name__": "__main__"}
    for block in python_blocks(path):
        if not block.runs:
            continue
        where = f"{path.relative_to(ROOT)}:{block.line}"
        code = compile(block.code, where, "exec")
        exec(code, namespace)  # noqa: S102 - the documentation's own example


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_compiles(path: Path) -> None:
    """Blocks marked no-run are fragments, but still valid Python."""
    for block in python_blocks(path):
        compile(block.code, f"{path.relative_to(ROOT)}:{block.line}", "exec")


def test_the_convention_is_found(tmp_path: Path) -> None:
    """The parser sees the marker, languages and bodies as written (a file of our own)."""
    text = ("intro\n\n```python\nx = 1\n```\n\n<!-- no-run -->\n```python\nmodel(x)\n```\n"
            "\n```\norgel demo\n```\n\n- item\n\n  ```python\n  y = 2\n  ```\n")
    path = tmp_path / "page.md"
    path.write_text(text)
    blocks = code_blocks(path)
    assert [(b.language, b.runs, b.code) for b in blocks] == [
        ("python", True, "x = 1\n"), ("python", False, "model(x)\n"),
        ("", True, "orgel demo\n"), ("python", True, "y = 2\n")]


def test_docs_pages_are_in_the_nav() -> None:
    """Every page under docs/ is reachable from the site's navigation."""
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f": {p.name}" not in nav]
    assert missing == [], f"add these pages to the nav in mkdocs.yml: {missing}"


def test_cli_reference_lists_every_command() -> None:
    """The CLI page's generator writes the help of orgel and of every sub-command."""
    spec = importlib.util.spec_from_file_location("cli_reference",
                                                  ROOT / "docs" / "hooks" / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    text = hook.reference()
    from orgel.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in sub.choices:
        assert f"## `orgel {name}`" in text
    assert "## `orgel checkpoint export`" in text
    assert "usage: orgel demo" in text


@pytest.mark.slow
def test_site_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict``: a broken link, anchor or API reference fails the suite."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip('mkdocs is not installed (pip install -e ".[docs]")')
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "cli" / "index.html").exists()


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and mkdocs' toc both write it for the headings here."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"\s+", "-", text)


def test_readme_links_point_at_files_and_headings() -> None:
    """README.md is read on GitHub, outside the site's strict build: its links are checked here."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        target, _, anchor = link.partition("#")
        path = ROOT / target
        assert path.exists(), f"README.md links to {target}, which does not exist"
        if anchor:
            headings = [line.lstrip("#").strip() for line in path.read_text().splitlines()
                        if line.startswith("#")]
            slugs = {_slug(h) for h in headings}
            assert anchor in slugs, f"README.md: no heading #{anchor} in {target}"


def test_the_file_formats_shown_are_read_back() -> None:
    """The plan file and the costs file shown in the docs load as orgel reads them."""
    import json

    from orgel.costs.blocks import BlockCosts
    from orgel.schedule import Plan

    plan_files = [b for b in code_blocks(ROOT / "docs" / "plans.md")
                  if b.language == "json" and '"version"' in b.code]
    costs_files = [b for b in code_blocks(ROOT / "docs" / "planning.md")
                   if b.language == "json" and b.code.startswith('{"blocks"')]
    assert plan_files and costs_files
    for block in plan_files:
        plan = Plan.from_json(block.code)
        assert plan.num_ranks == json.loads(block.code)["num_ranks"]
    for block in costs_files:
        costs = BlockCosts.from_dict(json.loads(block.code))
        assert len(costs.fwd) == len(json.loads(block.code)["blocks"])


def test_the_simulate_examples_print_the_step_times_shown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``orgel simulate`` lines in docs/plans.md run, and print the step time their comment says."""
    import shlex

    from orgel.cli import main
    from orgel.schedule import build_schedule

    monkeypatch.chdir(tmp_path)
    build_schedule("1f1b", 2, 4).save("plan.json")  # what the last example reads
    lines = [line for b in code_blocks(ROOT / "docs" / "plans.md") if b.language == ""
             for line in b.code.splitlines() if line.startswith("orgel simulate ")]
    assert len(lines) >= 4
    for line in lines:
        command, _, comment = line.partition("#")
        assert main(shlex.split(command)[1:]) == 0, line
        out = capsys.readouterr().out
        expected = re.search(r"[\d.]+", comment)
        if expected:
            shown = (re.search(r'"step_time": ([\d.]+)', out) or
                     re.search(r"step time ([\d.]+) ms", out))
            assert shown is not None and float(shown[1]) == float(expected[0]), (line, out[:300])
