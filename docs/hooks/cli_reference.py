"""mkdocs hook: fill the CLI reference page with ``orgel --help`` and every sub-command's help.

The page ``cli.md`` holds the marker ``<!-- orgel-help -->``; at build time it is replaced by
the help text of the parser ``orgel`` itself runs (:func:`orgel.cli.build_parser`), so the
reference cannot drift from the command.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

MARKER = "<!-- orgel-help -->"


def _parsers(parser: argparse.ArgumentParser,
             path: str) -> list[tuple[str, argparse.ArgumentParser]]:
    """``[("orgel", parser), ("orgel demo", ...), ("orgel checkpoint info", ...), ...]``."""
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _parsers(sub, f"{path} {name}")
    return found


def reference() -> str:
    """The help of ``orgel`` and of every sub-command, as Markdown sections."""
    from orgel.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: fix it for the page
    parts = []
    for path, parser in _parsers(build_parser(), "orgel"):
        parser.prog = path
        parts.append(f"## `{path}`\n\n```text\n$ {path} --help\n{parser.format_help()}```\n")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, reference())
    return markdown
