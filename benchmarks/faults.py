"""How fast a fault ends a step: time from the fault to the step's error, and to the last exit.

Each case (``tests/test_faults.py``'s: an exception in the loss, in the
optimizer, a rank stopped with SIGSTOP) starts ``orgel.pipeline`` on 2 local
ranks with a 6 s timeout, trains one step, injects the fault and runs a step:
the table gives the seconds until that step raised, until every worker process
was gone, and the first line of the error::

    python benchmarks/faults.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_faults import TIMEOUT_S, _gone, run_fault  # noqa: E402 - the test's cases


def main() -> None:
    print(f"2 local ranks, timeout {TIMEOUT_S:g} s, load {os.getloadavg()[0]:.1f}")
    print(f"{'fault':<10} {'step raised s':>13} {'all exited s':>12}  first line of the error")
    for fault in ("loss", "optimizer", "sigstop"):
        with tempfile.TemporaryDirectory() as tmp:
            message, raised, pids, begin = run_fault(Path(tmp) / "fault", fault)
            while not all(_gone(p) for p in pids):
                time.sleep(0.01)
            exited = time.monotonic() - begin
        print(f"{fault:<10} {raised:>13.2f} {exited:>12.2f}  {message.splitlines()[0][:110]}")


if __name__ == "__main__":
    main()
