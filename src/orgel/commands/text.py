"""Text formatting shared by the sub-commands: their help's examples, their tables."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def command_parser(sub: argparse._SubParsersAction, name: str, help: str,
                   examples: Sequence[str]) -> argparse.ArgumentParser:
    """A sub-command's parser whose help says what it does in one line and shows examples."""
    return sub.add_parser(name, help=help, description=help, epilog=examples_text(examples),
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def examples_text(examples: Sequence[str]) -> str:
    """``examples:`` and one indented command line each, for a parser's epilog."""
    return "example" + ("s" if len(examples) > 1 else "") + ":\n" + "\n".join(
        f"  {line}" for line in examples)


def human_bytes(nbytes: float) -> str:
    """Bytes in binary units: ``512 B``, ``1.5 KiB``, ``3.0 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def precision_argument(parser: argparse.ArgumentParser) -> None:
    """``--precision`` for a command line (:mod:`orgel.precision` trains it)."""
    from orgel.names import PRECISION_DTYPES

    parser.add_argument("--precision", default="32", choices=list(PRECISION_DTYPES),
                        help="'32' (default), 'bf16-mixed' (the forward and the loss under "
                             "torch.autocast with bfloat16, float32 parameters) or '16-mixed' "
                             "(float16 with loss scaling)")
