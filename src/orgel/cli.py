"""The ``orgel`` command: one sub-command per module in :mod:`orgel.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from orgel.commands.text import command_parser, examples_text

# Each module defines NAME, HELP (what it does, one line), EXAMPLES (command lines shown in its
# --help), add_arguments(parser) and run(args) -> int.
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
# shown by ``orgel --help``
EXAMPLES = (
    "orgel demo",
    "orgel run examples/gpt.py:workload --ranks 2 --schedule 1f1b --microbatches 4 --check",
)


def _load_commands() -> list[ModuleType]:
    return [importlib.import_module(f"orgel.commands.{name}") for name in _COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orgel",
        description="Automatic pipeline parallelism for PyTorch training: capture a model, plan "
        "where every\noperation runs and in which order, simulate and run the plan.",
        epilog=examples_text(EXAMPLES) + "\n\n'orgel COMMAND --help' shows a command's options "
        "and examples.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _load_commands():
        p = command_parser(sub, module.NAME, module.HELP, module.EXAMPLES)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    from orgel.launch.processes import watch_stacks
    from orgel.usercode import UserCodeError, user_code

    watch_stacks()

    # a command on a workload runs the user's code (the file, its model and loss): what that
    # raises is shown as the user's error, under the workload's name
    spec = getattr(args, "workload", None)
    try:
        if not isinstance(spec, str):
            return int(args._run(args) or 0)
        with user_code(spec, diagnoses=_orgel_errors()):
            return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("orgel: interrupted", file=sys.stderr)
        return 130
    except UserCodeError as exc:  # the workload's own error: its frames, under its name
        print(f"orgel {args.command}: {exc}", file=sys.stderr)
        return 1
    except _orgel_errors() as exc:  # orgel's own: the message says what to change
        print(f"orgel {args.command}: {exc}", file=sys.stderr)
        return 2


def _orgel_errors() -> tuple[type[BaseException], ...]:
    """The exceptions orgel raises to say what to change; anything else keeps its traceback."""
    from orgel.costs.fields import CostsFileError
    from orgel.graph.opgraph import CaptureError
    from orgel.plan.planner import InfeasibleError
    from orgel.runtime.checkpoint import CheckpointError
    from orgel.schedule.ir import PlanError
    from orgel.split.split import SplitError
    from orgel.workload import WorkloadError

    return (CaptureError, CheckpointError, CostsFileError, InfeasibleError, PlanError,
            SplitError, WorkloadError)


if __name__ == "__main__":
    sys.exit(main())
