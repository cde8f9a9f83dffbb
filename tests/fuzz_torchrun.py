"""The fuzzer's torchrun entry points: a drawn setup through ``orgel.pipeline`` or
``orgel.backend`` under torchrun.

:func:`launch` (in the fuzzer's process) writes the setup to a folder and starts
``python -m torch.distributed.run`` on this file with one process per rank; every process runs
:func:`fuzzing.run_orgel` as a user's script would (the same ``orgel.pipeline`` call, or
``orgel.backend`` and its closures, and loop: each process steps the same batches), saving
the checkpoint into that folder, and process 0 writes the :class:`fuzz_verdict.Result`
there for :func:`launch` to return. A refusal is passed back as one too
(:class:`fuzzing.Refused`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from torchrun_job import torchrun

RESULT = "result.pt"


def launch(setup: Any, timeout_s: float) -> Any:
    """Train ``setup`` (a :class:`fuzzing.Setup`) under torchrun; process 0's Result."""
    import fuzzing

    with tempfile.TemporaryDirectory(prefix="orgel-fuzz-") as tmp:
        folder = Path(tmp)
        (folder / "setup.json").write_text(json.dumps(dataclasses.asdict(setup)))
        try:  # start-up and capture come first
            code: int | str = torchrun(Path(__file__), str(folder), processes=setup.ranks,
                                       log=folder / "torchrun.log", timeout_s=timeout_s + 120,
                                       pythonpath=[Path(__file__).parent])
        except subprocess.TimeoutExpired:
            code = "killed at its timeout"
        if not (folder / RESULT).exists():
            tail = (folder / "torchrun.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"torchrun exited {code} without a result:\n{tail}")
        got = torch.load(folder / RESULT, weights_only=False)
    if isinstance(got, str):
        raise fuzzing.Refused(got)
    return got


def main(folder: Path) -> None:
    """One process of the job: the setup's run, process 0 keeps what it gives."""
    import fuzzing

    values = json.loads((folder / "setup.json").read_text())
    setup = fuzzing.Setup(**{k: tuple(v) if isinstance(v, list) else v
                             for k, v in values.items()})
    try:
        result: Any = fuzzing.run_orgel(setup, folder=folder / "checkpoint")
    except fuzzing.Refused as exc:
        result = str(exc)
        print(f"process {os.environ['RANK']}: refused: {exc}", file=sys.stderr)
    if int(os.environ["RANK"]) == 0:
        torch.save(result, folder / RESULT)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
