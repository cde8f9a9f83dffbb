"""``orgel run``, ``graph``, ``profile`` and ``plan`` on a workload whose own code fails: the
user's frames under the workload's name, exit code 1, none of orgel's frames; what orgel finds
itself in one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the real command line, in a process of its own

SRC = Path(__file__).resolve().parent.parent / "src"  # this checkout's orgel, first

MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, cols):
        super().__init__()
        self.a, self.cols = nn.Linear(8, 8), cols

    def forward(self, x):
        return self.a(x) @ torch.ones(self.cols, 4)


def data():
    torch.manual_seed(0)
    return torch.randn(8, 8), torch.randn(8, 4)
'''

WORKLOADS = {
    # (file text, the error's last line, the user's line that raised)
    "raises": (MODEL + '''

def read_rows():
    raise RuntimeError("no rows in the data file")


def workload():
    x, y = data()
    read_rows()
''', "RuntimeError: no rows in the data file", 'raise RuntimeError("no rows in the data file")'),
    "syntax": (MODEL + '''

def workload(:
    return None
''', "SyntaxError: invalid syntax", "def workload(:"),
    "forward": (MODEL + '''

def workload():
    x, y = data()
    return Net(3), (x,), y, nn.functional.mse_loss
''', "RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x8 and 3x4)",
                "return self.a(x) @ torch.ones(self.cols, 4)"),
    "nan": (MODEL + '''

def workload():
    x, y = data()
    x[0, 0] = float("nan")
    return Net(8), (x,), y, nn.functional.mse_loss
''', None, None),
}


def orgel(tmp_path: Path, command: str, name: str,
          *extra: str) -> tuple[str, subprocess.CompletedProcess[str]]:
    """``orgel COMMAND`` on workload ``name`` in a process of its own: (its spec, the result)."""
    path = tmp_path / f"{name}.py"
    path.write_text(WORKLOADS[name][0])
    spec = f"{path}:workload"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-m", "orgel.cli", command, spec, *extra],
                         capture_output=True, text=True, env=env, timeout=300)
    return spec, out


def orgel_run(tmp_path: Path, name: str,
              *extra: str) -> tuple[str, subprocess.CompletedProcess[str]]:
    return orgel(tmp_path, "run", name, "--ranks", "2", "--microbatches", "2", "--steps", "1",
                 *extra)


@pytest.mark.parametrize(("command", "name"), [("run", "raises"), ("run", "syntax"),
                                               ("run", "forward"), ("graph", "forward"),
                                               ("profile", "forward"), ("plan", "raises")])
def test_the_workloads_own_error_shows_its_frames_only(command: str, name: str,
                                                       tmp_path: Path) -> None:
    spec, out = (orgel_run(tmp_path, name) if command == "run"
                 else orgel(tmp_path, command, name, *(["--ranks", "2"] * (command == "plan"))))
    _, last, line = WORKLOADS[name]
    err = out.stderr
    assert out.returncode == 1, err
    assert err.startswith(f"orgel {command}: the workload {spec} failed: "), err
    assert err.rstrip().endswith(last), err
    assert line in err, err
    files = re.findall(r'^  File "([^"]+)"', err, flags=re.M)
    assert files and set(files) == {str(tmp_path / f"{name}.py")}, err  # no orgel frame
    assert "orgel/cli.py" not in err and "orgel/workload.py" not in err, err


def test_a_non_finite_loss_is_one_line(tmp_path: Path) -> None:
    # the loss rule's trial at start-up meets the NaN first, before any rank starts
    _, out = orgel_run(tmp_path, "nan")
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("orgel run: the trial loss is not finite (whole batch nan"), \
        out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    # with the rule given there is no trial: the rank that computes the loss stops
    spec, out = orgel_run(tmp_path, "nan", "--check-finite", "--loss-rule", "rows")
    err = out.stderr
    assert out.returncode == 1, err
    assert err.startswith(f"orgel run: the workload {spec} failed\n"), err
    assert re.search(r"^rank 1 failed in run: NonFiniteLoss: the loss of micro-batch 0 is nan",
                     err, flags=re.M), err
    assert "Traceback" not in err and 'File "' not in err, err


def test_a_check_on_a_loss_that_is_nan_says_so_in_one_line(tmp_path: Path) -> None:
    """``--check`` compares the losses and weights with one process's; a NaN loss leaves
    nothing to compare, and it said `RuntimeError: atol must be greater than or equal to
    zero, but got -nan` from orgel's own comparison."""
    _, out = orgel_run(tmp_path, "nan", "--check", "--loss-rule", "rows")  # (no trial)
    err = out.stderr
    assert out.returncode == 1, err
    assert "step 1: loss nan" in out.stdout, out.stdout
    assert err.rstrip().splitlines()[-1].startswith(
        "check: the loss is nan from step 1 on (one process's too, from step 1), so there is "
        "nothing to compare; the data or the initial weights hold a NaN"), err
    assert "Traceback" not in err and "atol" not in err, err
