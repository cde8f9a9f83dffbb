"""examples/train_hf.py, run as a user runs it, against the same loop in plain PyTorch.

The example (a Qwen2 from a config, a DataLoader of right-padded documents with labels
-100 on the padding, the model's own loss, AdamW with warm-up and cosine decay, clipping,
evaluation perplexity, checkpoints, save_pretrained) runs in a subprocess on 2 local ranks
(stopped at a checkpoint) and resumed under torchrun. Its log (every step's loss and
learning rate, every evaluation's perplexity) and the model it saves must equal one process
running the same loop on the whole batches.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from example_scripts import load_example
from orgel.launch.processes import free_port

pytestmark = [pytest.mark.slow, pytest.mark.hf]

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_hf.py"
STEPS, EVERY = 4, 2


def _example() -> ModuleType:
    return load_example(EXAMPLE, "train_hf_example")


def _run(cmd: list[str], cwd: Path) -> None:
    """Run ``cmd`` as a user would; on a hang, kill it with every process it started."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = cwd / "output.txt"
    with open(log, "w") as out:  # a file, not a pipe: a stray rank cannot keep it open
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    assert proc.returncode == 0, log.read_text(errors="replace")[-4000:]


def _reference(steps: int) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """The example's loop in one process, plain PyTorch, on whole batches."""
    from transformers import get_cosine_schedule_with_warmup

    ex = _example()
    args = ex.arguments(["--steps", str(steps)])
    model = ex.build_model(args.seed)
    train, valid = ex.loaders(args.batch_size, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, args.steps)
    log: list[dict[str, Any]] = []
    for step, batch in zip(range(steps), ex.endless(train), strict=False):
        lr = sched.get_last_lr()[0]
        model.train()
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        log.append({"step": step, "loss": loss.item(), "lr": lr})
        if (step + 1) % EVERY == 0:
            model.eval()
            with torch.no_grad():
                total = sum(model(**b).loss.item() * ex.tokens(b) for b in valid)
            ppl = math.exp(total / sum(ex.tokens(b) for b in valid))
            log.append({"eval_step": step + 1, "perplexity": ppl})
    return log, model.state_dict()


def _check(out: Path, expected: list[dict[str, Any]], state: dict[str, torch.Tensor]) -> None:
    from transformers import Qwen2ForCausalLM

    got = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [e.keys() for e in got] == [e.keys() for e in expected], got
    for g, e in zip(got, expected, strict=True):
        for key, value in e.items():
            assert g[key] == pytest.approx(value, rel=1e-4, abs=1e-7), (key, g, e)
    saved = Qwen2ForCausalLM.from_pretrained(out / "model").state_dict()
    assert saved.keys() == state.keys()
    for name, value in state.items():
        torch.testing.assert_close(saved[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_the_example_stops_and_resumes_under_torchrun_as_one_process(tmp_path: Path) -> None:
    """Stopped at a checkpoint on 2 local ranks, resumed from it under torchrun: every
    step's loss and learning rate, the evaluations and the saved model equal one process's
    uninterrupted loop (a checkpoint does not depend on the launcher that wrote it)."""
    expected, state = _reference(STEPS)
    padded = next(iter(_example().loaders(8, 0)[0]))
    assert (padded["labels"] == -100).any()  # the batches are padded
    every = ["--eval-every", str(EVERY), "--save-every", str(EVERY)]
    _run([sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--stop-at", str(STEPS // 2),
          "--out", "run", *every], tmp_path)
    assert (tmp_path / "run" / "checkpoints" / "LATEST").exists()
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
          "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(EXAMPLE),
          "--steps", str(STEPS), "--resume", "--out", "run", *every], tmp_path)
    _check(tmp_path / "run", expected, state)
    assert (tmp_path / "run" / "checkpoints" / f"step-{STEPS:08d}" / "rank1.pt").exists()
