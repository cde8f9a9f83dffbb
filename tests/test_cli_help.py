"""``orgel --help`` and every sub-command's help say what it does in one line and show examples
that the command accepts."""

from __future__ import annotations

import argparse
import shlex

import pytest

from orgel.cli import build_parser


def _commands() -> list[tuple[str, argparse.ArgumentParser]]:
    """``("orgel", parser)``, ``("orgel demo", ...)``, ..., ``("orgel checkpoint info", ...)``."""
    found: list[tuple[str, argparse.ArgumentParser]] = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        found.append((path, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")

    walk(build_parser(), "orgel")
    return found


def _examples(help_text: str) -> list[str]:
    lines = help_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line in ("example:", "examples:"))
    return [line.strip() for line in lines[start + 1:] if line.startswith("  ")]


@pytest.mark.parametrize("path", [path for path, _ in _commands()])
def test_help_says_what_it_does_in_one_line_and_shows_examples(path: str) -> None:
    parser = dict(_commands())[path]
    text = parser.format_help()
    description = parser.description or ""
    assert description.strip(), f"{path}: no description"
    if path != "orgel":
        assert "\n" not in description, f"{path}: the description is more than one line"
        assert len(description) <= 100, f"{path}: the description is longer than a line"
    examples = _examples(text)
    assert examples, f"{path} --help shows no example"
    for example in examples:
        words = shlex.split(example)
        assert words[0] == "orgel"
        if path != "orgel":
            assert example.startswith(path + " ") or example == path, example
        build_parser().parse_args(words[1:])  # the example is a command orgel accepts



@pytest.mark.slow
def test_help_starts_without_importing_torch() -> None:
    """``orgel --help`` and every command's help answer at once: building the parsers (and
    ``import orgel``) imports no torch, which takes seconds to import."""
    import subprocess
    import sys

    code = ("import sys, orgel\nfrom orgel.cli import build_parser\nbuild_parser()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout[-500:]
