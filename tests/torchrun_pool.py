"""Scripts of several test modules, run one after another in one torchrun job.

Each script a test runs under torchrun costs the job's start: torchrun's own process and
every rank importing torch, orgel and Dynamo afresh (about 10 s of CPU for 2 ranks here).
The scripts of 2 processes share that start: a test names its part with
``@pytest.mark.torchrun_part(NAME)``, its module lists the part in ``TORCHRUN_PARTS``
(``NAME -> (script text, extra arguments)``), and the ``torchrun_part`` fixture
(``conftest.py``) runs every part the session selected in one job, the first time a test
asks, and hands each test its part's folder. The script gets that folder as ``sys.argv[1]``
(the extra arguments after it), as it would on its own.

The parts run in the same processes, as several pipelines do in a user's script (a
pipeline built, closed and another built). A part that raises on a rank ends that rank
(torchrun then ends the others): the tests of the parts after it fail saying which part
stopped the job, with its error; a part that takes longer than :data:`PART_TIMEOUT_S`
ends its rank with every thread's stack in the job's log. Parts whose names start with
``last-`` run after the others (they end the process group, as a script's exit does).
Between parts the driver
collects the finished part's garbage: ``runpy`` leaves a script's objects in reference
cycles that a script's own process would end with, and a closed pipeline among them held
gloo's threads past ``leave_group``. The last part checks that nothing of gloo's is left
after ``leave_group``: run after the sharded and tensor-parallel parts, it found that
DTensor's caches kept their device meshes, and with them a group, alive
(:func:`orgel.launch.meshes.forget_meshes`, which ``leave_group`` calls, now empties
them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from torchrun_job import torchrun

#: the pool's processes (a part of another count runs as a job of its own)
PROCESSES = 2

#: seconds a part may take before its rank prints every thread's stack and ends
PART_TIMEOUT_S = 180

DRIVER = '''
import faulthandler, gc, json, os, runpy, sys, traceback
from pathlib import Path

rank = os.environ["RANK"]
for name, script, folder, args, timeout_s in json.loads(Path(sys.argv[1]).read_text()):
    sys.argv = [script, folder, *args]
    print(f"part {name} starts on rank {rank}", file=sys.stderr, flush=True)
    # a part that hangs ends its rank (torchrun then ends the job), its stacks in the log
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException:
        Path(folder, f"failed{rank}.txt").write_text(traceback.format_exc())
        print(f"part {name} failed on rank {rank}", file=sys.stderr, flush=True)
        sys.exit(1)
    faulthandler.cancel_dump_traceback_later()
    gc.collect()  # the part's cycles, as its process's end would drop them (see the docstring)
    Path(folder, f"done{rank}").touch()
'''


class Pool:
    """The parts a session selected, run once in one job (:meth:`folder`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.parts: dict[str, tuple[str, list[str]]] = {}
        self._ran = False

    def add(self, name: str, module: Any) -> None:
        """Take part ``name`` from ``module.TORCHRUN_PARTS``."""
        text, args = module.TORCHRUN_PARTS[name]
        self.parts[name] = (text, list(args))

    def folder(self, name: str) -> Path:
        """Part ``name``'s folder, after the job ran; fails the test where that part did not
        finish on every process."""
        if not self._ran:
            self._ran = True
            self._run()
        folder = self.root / name
        if all((folder / f"done{r}").exists() for r in range(PROCESSES)):
            return folder
        log = (self.root / "torchrun.log").read_text(errors="replace")
        errors = sorted(self.root.glob("*/failed*.txt"))
        if folder.exists() and any(e.parent == folder for e in errors):
            trace = "\n".join(e.read_text() for e in errors if e.parent == folder)
            pytest.fail(f"part {name} raised under torchrun:\n{trace}\n{log[-2000:]}")
        stopped = ", ".join(f"{e.parent.name} ({e.name})" for e in errors) or "none raised"
        pytest.fail(f"part {name} did not finish: the job stopped before it or in it "
                    f"(parts that raised: {stopped}):\n{log[-3000:]}")

    def _run(self) -> None:
        order = sorted(self.parts, key=lambda n: n.startswith("last-"))
        listing = []
        for name in order:
            text, args = self.parts[name]
            folder = self.root / name
            folder.mkdir(parents=True)
            script = folder / "script.py"
            script.write_text(text)
            listing.append([name, str(script), str(folder), args, PART_TIMEOUT_S])
        parts = self.root / "parts.json"
        parts.write_text(json.dumps(listing))
        driver = self.root / "driver.py"
        driver.write_text(DRIVER)
        torchrun(driver, str(parts), processes=PROCESSES, log=self.root / "torchrun.log",
                 timeout_s=60 + PART_TIMEOUT_S * len(listing))
