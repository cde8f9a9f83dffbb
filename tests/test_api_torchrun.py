"""The same orgel.pipeline script under torchrun (SPMD): every rank runs it, results agree."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orgel.runtime.launch import free_port

pytestmark = pytest.mark.slow

SCRIPT = '''
import json, sys
import torch
import orgel.explicit.api as api
from orgel.models import build

model, inputs, targets, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32)
reference = __import__("copy").deepcopy(model)
sgd = lambda params: torch.optim.SGD(params, lr=0.05)
pipe = api.pipeline(model, inputs, targets, loss_fn, ranks=2, microbatches=4, optimizer=sgd)
losses = [pipe.step(inputs, targets) for _ in range(2)]
state = pipe.state_dict()                       # gathered from both ranks, on every rank
pipe.save(sys.argv[1])
opt = sgd(list(reference.parameters()))
ref_losses = []
for _ in range(2):
    opt.zero_grad()
    loss = loss_fn(reference(*inputs), targets)
    loss.backward()
    opt.step()
    ref_losses.append(loss.item())
diff = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
rank = torch.distributed.get_rank()
with open(f"{sys.argv[1]}/result{rank}.json", "w") as f:
    json.dump({"losses": losses, "ref": ref_losses, "diff": diff, "spmd": pipe.spmd}, f)
pipe.close()
'''


def _kill_running(marker: str) -> None:
    """SIGKILL every process whose command line mentions ``marker``."""
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (proc_dir / "cmdline").read_bytes().decode(errors="replace"):
                os.kill(int(proc_dir.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def test_pipeline_script_runs_unchanged_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Output goes to a file, not a pipe: a pipe held open by a stray rank would
    # keep communicate() waiting after torchrun itself has exited or been killed.
    log = tmp_path / "torchrun.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script),
             str(tmp_path / "ckpt")],
            stdout=out, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True,  # so a hang can be killed with every rank it started
        )
        try:
            proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _kill_running(str(script))  # ranks torchrun started in sessions of their own
            proc.wait()
            raise
    stderr = log.read_text(errors="replace")
    assert proc.returncode == 0, stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / "ckpt" / f"result{rank}.json").read_text())
        assert result["spmd"] is True
        assert result["losses"] == pytest.approx(result["ref"], rel=1e-5)
        assert result["diff"] < 1e-5
    assert (tmp_path / "ckpt" / "step-00000002" / "rank1.pt").exists()
