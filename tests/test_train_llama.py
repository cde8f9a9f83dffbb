"""examples/train_llama.py, a real training run, against one process running the same loop.

The example is run as a user runs it (a subprocess: `python examples/train_llama.py`, which
forks 2 local ranks; then under torchrun). Its JSON log (loss, learning rate and gradient
norm of every step, validation loss of every evaluation) and its exported state_dict are
compared with the same loop in plain PyTorch in this process: the same model, batches of
varying length, AdamW with two groups by name, warm-up and cosine decay, clipping,
evaluation in eval mode without gradients. One run stops at a checkpoint and a second,
under torchrun, resumes from it; together they must equal the uninterrupted reference.
"""

from __future__ import annotations

import json
import math
import os
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
EXAMPLE = ROOT / "examples" / "train_llama.py"
SMALL = ["--batch-size", "4", "--microbatches", "2", "--min-length", "8", "--max-length",
         "24", "--warmup", "2", "--eval-every", "2", "--eval-batches", "1"]
STEPS = 4


def _example() -> ModuleType:
    return load_example(EXAMPLE, "train_llama_example")


def _args(tmp_path: Path, *more: str) -> list[str]:
    return [*SMALL, "--checkpoint", str(tmp_path / "ckpt"), *more]


def _run(cmd: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def _log(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [e for e in lines if "step" in e], [e for e in lines if "eval_step" in e]


def _reference(steps: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                    dict[str, torch.Tensor]]:
    """The example's loop in one process, plain PyTorch."""
    ex = _example()
    args = ex.arguments(SMALL + ["--steps", str(steps)])
    stream = ex.token_stream()
    cut = int(stream.numel() * 0.9)
    lengths = (args.min_length, args.max_length)
    model = ex.build_model(args.seed)
    opt = torch.optim.AdamW(ex.param_groups(model.named_parameters(), args.weight_decay),
                            lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, ex.warmup_cosine(args.warmup, args.steps))
    trained, evals = [], []
    for step in range(steps):
        x, y = ex.batch(stream[:cut], step, size=args.batch_size, lengths=lengths,
                        seed=args.seed)
        lr = sched.get_last_lr()[0]
        model.train()
        loss = ex.loss_fn(model(**x), y)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        sched.step()
        trained.append({"step": step, "length": x["input_ids"].shape[1], "loss": loss.item(),
                        "lr": lr, "grad_norm": float(norm)})
        if (step + 1) % args.eval_every == 0:
            model.eval()
            with torch.no_grad():
                vx, vy = ex.batch(stream[cut:], 0, size=args.batch_size, lengths=lengths,
                                  seed=args.seed + 1)
                val = ex.loss_fn(model(**vx), vy).item()
            evals.append({"eval_step": step + 1, "eval_loss": val,
                          "perplexity": math.exp(val)})
    return trained, evals, model.state_dict()


def _compare(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.keys() == e.keys()
        for key, value in e.items():
            assert g[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (key, g, e)


def test_the_example_checkpoints_and_resumes_under_torchrun_as_one_process(tmp_path: Path,
                                                                           ) -> None:
    """A run stopped at a checkpoint on 2 local ranks and a second one resuming from it
    under torchrun equal one process's uninterrupted loop: every step's log, the
    evaluations and the weights exported from the caller's model at the end."""
    trained, evals, state = _reference(STEPS)
    assert len({e["length"] for e in trained}) > 1  # the lengths vary
    half = str(STEPS // 2)
    _run([sys.executable, str(EXAMPLE), *_args(tmp_path, "--steps", str(STEPS), "--stop-at", half,
                                                "--save-every", half,
                                                "--log-file", str(tmp_path / "b.jsonl"))], tmp_path)
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
          "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(EXAMPLE),
          *_args(tmp_path, "--steps", str(STEPS), "--resume", "--log-file",
                 str(tmp_path / "b.jsonl"), "--export", str(tmp_path / "model.pt"))], tmp_path)
    resumed, resumed_evals = _log(tmp_path / "b.jsonl")
    _compare(resumed, trained)
    _compare(resumed_evals, evals)
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert list(exported) == list(state)
    for name, value in state.items():
        torch.testing.assert_close(exported[name], value, rtol=1e-4, atol=1e-5, msg=name)
