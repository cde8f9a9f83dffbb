"""The ``orgel`` command: one sub-command per module in :mod:`orgel.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

# Each module defines NAME, HELP, add_arguments(parser) and run(args) -> int.
# Order here is the order in ``orgel --help``.
_COMMANDS = (
    "demo",
    "run",
    "plan",
    "simulate",
    "show",
    "graph",
    "profile",
    "checkpoint",
)


def _load_commands() -> list[ModuleType]:
    return [importlib.import_module(f"orgel.commands.{name}") for name in _COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orgel",
        description="Automatic pipeline parallelism for PyTorch training: capture a model, "
        "plan where every operation runs and in which order, simulate and run the plan.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _load_commands():
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("orgel: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
