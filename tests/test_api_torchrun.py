"""The same orgel.pipeline script under torchrun (SPMD): every rank runs it, results agree."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from torchrun_job import torchrun

pytestmark = pytest.mark.slow

SCRIPT = '''
import json, sys
import torch
import orgel.explicit.api as api
from orgel.models import build
from gaps import state_gap

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
diff = state_gap(state, reference.state_dict())
rank = torch.distributed.get_rank()
with open(f"{sys.argv[1]}/result{rank}.json", "w") as f:
    json.dump({"losses": losses, "ref": ref_losses, "diff": diff, "spmd": pipe.spmd}, f)
pipe.close()
'''


def _torchrun(tmp_path: Path, script_text: str, *args: str,
             processes: int = 2) -> tuple[int, str]:
    """Run ``script_text`` on ``processes`` ranks under torchrun; its exit code and output."""
    script = tmp_path / "train.py"
    script.write_text(script_text)
    log = tmp_path / "torchrun.log"
    code = torchrun(script, *args, processes=processes, log=log, timeout_s=180)
    return code, log.read_text(errors="replace")


@pytest.mark.xdist_group("torchrun-pool")
@pytest.mark.torchrun_part("api-script")
def test_pipeline_script_runs_unchanged_under_torchrun(torchrun_part: Path) -> None:
    for rank in (0, 1):
        result = json.loads((torchrun_part / f"result{rank}.json").read_text())
        assert result["spmd"] is True
        assert result["losses"] == pytest.approx(result["ref"], rel=1e-5)
        assert result["diff"] < 1e-5
    assert (torchrun_part / "step-00000002" / "rank1.pt").exists()


FAULTY = '''
import os, sys, time
import torch
import torch.nn.functional as F
from torch import nn
import orgel

calls = [0]


def loss(out, y):
    # rank 0 also calls it, when it profiles the model (unless a cached profile serves)
    calls[0] += os.environ["RANK"] == "1"
    if calls[0] > 2:  # the second step, on the rank that computes the loss (rank 1)
        with open(sys.argv[1], "w") as f:
            f.write(repr(time.time()))
        raise RuntimeError("the loss cannot be computed")
    return F.mse_loss(out, y)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
x, y = torch.randn(8, 8), torch.randn(8, 4)
pipe = orgel.pipeline(model, (x,), y, loss, ranks=2, microbatches=2, timeout_s=60,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
for _ in range(3):
    pipe.step((x,), y)
'''


def test_a_rank_that_raises_under_torchrun_stops_the_other_within_seconds(
        tmp_path: Path) -> None:
    """Rank 1's loss raises in step 2 while rank 0 waits for its gradient (timeout 60 s):
    rank 0 stops within seconds, and the output names rank 1, the action and the cause."""
    fault = tmp_path / "fault-time"
    code, out = _torchrun(tmp_path, FAULTY, str(fault))
    ended = time.time()
    assert code != 0
    assert "RuntimeError: the loss cannot be computed" in out, out[-3000:]
    assert "rank 1" in out and "[while running F1." in out, out[-3000:]
    assert ended - float(fault.read_text()) < 15, "rank 0 waited for its receive's timeout"


COPY_TO = '''
import copy, json, sys
import torch
import orgel
from orgel.models import build
from orgel.launch.errors import StepError
from gaps import state_gap

model, inputs, targets, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32)
initial = copy.deepcopy(model.state_dict())
reference = copy.deepcopy(model)
sgd = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)
pipe = orgel.pipeline(model, inputs, targets, loss_fn, ranks=2, microbatches=4, optimizer=sgd)
losses = [pipe.step(inputs, targets)]
bad = targets.clone()
bad[0, 0] = 10 ** 6  # no such token: the loss raises on the loss rank only
try:
    pipe.step(inputs, bad)
    dropped = ""
except StepError as exc:
    dropped = str(exc).splitlines()[0]
# each process its own batch, as a DistributedSampler gives it: refused on every process
own = [inputs[0].roll(torch.distributed.get_rank(), 0)]
try:
    pipe.step(own, targets)
    sharded = ""
except ValueError as exc:
    sharded = str(exc)
losses.append(pipe.step(inputs, targets))
untouched = all(torch.equal(model.state_dict()[k], v) for k, v in initial.items())
pipe.copy_to()
opt = sgd(list(reference.parameters()))
ref_losses = []
for _ in range(2):
    opt.zero_grad()
    loss = loss_fn(reference(*inputs), targets)
    loss.backward()
    opt.step()
    ref_losses.append(loss.item())
mine = model.state_dict()
diff = state_gap(mine, reference.state_dict())
rank = torch.distributed.get_rank()
with open(f"{sys.argv[1]}/result{rank}.json", "w") as f:
    json.dump({"losses": losses, "ref": ref_losses, "diff": diff, "untouched": untouched,
               "dropped": dropped, "sharded": sharded,
               "keys": list(mine) == list(reference.state_dict())}, f)
pipe.close()
'''


@pytest.mark.xdist_group("torchrun-pool")
@pytest.mark.torchrun_part("api-copy-to")
def test_torchrun_leaves_the_callers_model_alone_until_copy_to_and_survives_a_bad_batch(
        torchrun_part: Path) -> None:
    """Each rank's stages train copies: the caller's model is as it was on every rank
    until ``copy_to`` writes all of the trained values into it, on every rank. A target
    out of range raises in rank 1's loss: both ranks get StepError and train on as one
    process that skipped that batch. A batch per process (a DistributedSampler's shard)
    is refused on both before any rank starts (it trained process 0's inputs on process
    1's labels), and the pipeline trains on."""
    for rank in (0, 1):
        result = json.loads((torchrun_part / f"result{rank}.json").read_text())
        assert result["untouched"] is True
        assert result["losses"] == pytest.approx(result["ref"], rel=1e-5)
        assert result["diff"] < 1e-5 and result["keys"] is True
        assert result["dropped"].startswith("rank 1 failed in step: IndexError"), result
        assert result["sharded"].startswith("pipe.step got another batch on process 1 than "
                                            "on process 0 (input 'tokens' differ)"), result


AGAIN = '''
import json, os, sys
import torch
import torch.nn.functional as F
from torch import nn
import orgel
from torchrun_job import gloo_threads

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
x, y = torch.randn(8, 8), torch.randn(8, 4)
losses = []
for attempt in range(4):  # built, used, closed, and built again in the same processes
    with orgel.pipeline(model, (x,), y, F.mse_loss, ranks=2, microbatches=2, timeout_s=60,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1)) as pipe:
        losses.append([pipe.step((x,), y), pipe.step((x,), y)])
try:
    pipe.step((x,), y)
    closed = "a closed pipeline stepped"
except orgel.WorkerError as exc:
    closed = str(exc)
# what orgel does at exit, now: gloo's threads must end with the group, while the
# interpreter still runs (at its finalization they could abort the process)
orgel.launch.processes.leave_group()
gloo = gloo_threads()
with open(os.path.join(sys.argv[1], f"again{os.environ['RANK']}.json"), "w") as f:
    json.dump({"losses": losses, "closed": closed, "gloo": gloo}, f)
'''


def test_pipelines_built_again_in_the_same_torchrun_processes(tmp_path: Path) -> None:
    """Four pipelines, one after another, in the same two torchrun processes: the process
    group the first one made serves them all (made again, gloo's connect hung or crashed
    now and then under load) and goes at exit, with its threads (a closed pipeline holds
    none of it)."""
    code, log = _torchrun(tmp_path, AGAIN, str(tmp_path))
    assert code == 0, log[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"again{rank}.json").read_text())
        losses = result["losses"]
        assert len(losses) == 4 and all(run == losses[0] for run in losses)
        assert "closed" in result["closed"]
        assert result["gloo"] == []


GLUED = '''
import copy, json, os, sys, time
import torch
import torch.nn.functional as F
import orgel
from orgel.models.graphbreak import GraphBreakMLP
from gaps import state_gap
from torchrun_job import gloo_threads

torch.manual_seed(0)
model = GraphBreakMLP(8, 16, 4)
initial = copy.deepcopy(model)
x, y = torch.randn(8, 8), torch.randn(8, 4)
sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
out = sys.argv[1]
pipe = orgel.pipeline(model, (x,), y, F.mse_loss, ranks=2, microbatches=2, timeout_s=60,
                      optimizer=sgd)
losses = [pipe.step((x,), y)]
pipe.save(out)
pipe.close()
pipe = orgel.load(out, copy.deepcopy(initial), (x,), y, F.mse_loss, timeout_s=60,
                  optimizer=sgd)                 # resumed in the same processes
losses.append(pipe.step((x,), y))
sharded = []
for call in (pipe.step, pipe.evaluate):  # a batch per process: refused on every process
    try:
        call((x.roll(int(os.environ["RANK"]), 0),), y)
    except ValueError as exc:
        sharded.append(str(exc))
evaluated = pipe.evaluate((x,), y)


def failing(out, target):
    raise RuntimeError("the loss cannot be computed")


pipe.loss_fn = failing                           # process 0 computes the loss: it raises
began = time.monotonic()
try:
    pipe.step((x,), y)
except Exception as exc:
    with open(os.path.join(out, f"error{os.environ['RANK']}.txt"), "w") as f:
        f.write(f"{type(exc).__name__}: {exc}")
with open(os.path.join(out, f"stopped{os.environ['RANK']}.txt"), "w") as f:
    f.write(str(time.monotonic() - began))
pipe.loss_fn = F.mse_loss                        # every rank dropped that step: train on
losses.append(pipe.step((x,), y))
pipe.copy_to(model)                              # on every process: its own model
reference, ref_losses = copy.deepcopy(initial), []
opt = sgd(list(reference.parameters()))
for step in range(3):
    if step == 2:
        with torch.no_grad():
            reference.eval()
            ref_eval = sum(F.mse_loss(reference(xs), ys).item() / 2
                           for xs, ys in zip(x.chunk(2), y.chunk(2)))
            reference.train()
    opt.zero_grad()
    parts = [F.mse_loss(reference(xs), ys) / 2 for xs, ys in zip(x.chunk(2), y.chunk(2))]
    sum(parts).backward()
    opt.step()
    ref_losses.append(sum(p.item() for p in parts))
mine = model.state_dict()
diff = state_gap(mine, reference.state_dict())
with open(os.path.join(out, f"glued{os.environ['RANK']}.json"), "w") as f:
    json.dump({"losses": losses, "ref": ref_losses, "diff": diff, "steps": pipe.steps,
               "eval": [evaluated, ref_eval], "kind": type(pipe).__name__,
               "sharded": sharded}, f)
pipe.close()
orgel.launch.processes.leave_group()             # what orgel does at exit, now
with open(os.path.join(out, f"threads{os.environ['RANK']}.json"), "w") as f:
    json.dump(gloo_threads(), f)
'''


@pytest.mark.xdist_group("torchrun-pool")
@pytest.mark.torchrun_part("last-api-glued")
def test_a_forward_of_several_graphs_trains_under_torchrun(torchrun_part: Path) -> None:
    """A Python branch between two graphs, under torchrun: process 0 runs the controller
    beside its rank, process 1 serves it. Trained, saved, closed, resumed in the same
    processes, evaluated; a batch per process refused in step and evaluate on both
    processes; the controller's own error (its ``loss_fn``) then ends both
    processes' step, named, without a hang, every rank drops it and the next step trains:
    copied into each process's model, as one process trains. Run after the pool's other
    parts (it ends the process group), the sharded and tensor-parallel ones included, so
    that nothing of gloo's outliving the group also covers their device meshes."""
    kinds = set()
    for rank in (0, 1):
        result = json.loads((torchrun_part / f"glued{rank}.json").read_text())
        assert result["losses"] == pytest.approx(result["ref"], rel=1e-5), result
        assert result["diff"] < 1e-5 and result["steps"] == 3, result
        assert result["eval"][0] == pytest.approx(result["eval"][1], rel=1e-5), result
        kinds.add(result["kind"])
        assert [s.split(" (")[0] for s in result["sharded"]] == [
            "pipe.step got another batch on process 1 than on process 0",
            "pipe.evaluate got another batch on process 1 than on process 0"], result
    assert kinds == {"Leading", "Follower"}
    for rank in (0, 1):  # process 0's error, raised on both
        error = (torchrun_part / f"error{rank}.txt").read_text()
        assert error == "RuntimeError: the loss cannot be computed", rank
    for rank in (0, 1):  # at once, not after the 60 s timeout's wait for the controller
        assert float((torchrun_part / f"stopped{rank}.txt").read_text()) < 20, rank
        # nothing of gloo's outlives the group (at the interpreter's finalization its
        # threads could abort the exit); a failed step's autograd graph held it on process 0
        threads = json.loads((torchrun_part / f"threads{rank}.json").read_text())
        assert threads == [], threads


#: the scripts the shared torchrun job runs (``torchrun_pool.py``)
TORCHRUN_PARTS = {"api-script": (SCRIPT, []), "api-copy-to": (COPY_TO, []),
                  "last-api-glued": (GLUED, [])}
