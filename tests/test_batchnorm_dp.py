"""BatchNorm under data-parallel replicas: which rows each replica runs, and its statistics.

A stage on ``n`` ranks is data-parallel inside the stage: replica ``k`` runs rows
``[k*b/n, (k+1)*b/n)`` of every micro-batch of ``b`` rows
(:func:`orgel.batching.replica_rows`), through its own copy of the stage. Its
BatchNorm normalises with those rows' statistics and updates its own running
statistics; at the end of every training step the buffers a replicated stage
updates are averaged over its replicas (:mod:`orgel.runtime.buffers`), so every
replica, ``pipe.state_dict()``, checkpoints and ``pipe.evaluate`` see one value.

The one-process reference below does exactly that with plain PyTorch (see
:func:`_reference_step`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import orgel
from orgel.batching import replica_rows
from orgel.graph import capture
from orgel.models import build
from orgel.plan.balanced import balanced_plan
from orgel.runtime import checkpoint as ckpt
from orgel.workload import Workload, microbatches

pytestmark = pytest.mark.slow

ROWS, M, DP = 8, 2, 2  # 8 rows: 2 micro-batches of 4, each replica runs 2 rows of each


def test_replica_rows_cut_each_microbatch_into_contiguous_equal_shares() -> None:
    assert [replica_rows(8, k, 2) for k in range(2)] == [(0, 4), (4, 8)]
    assert [replica_rows(6, k, 3) for k in range(3)] == [(0, 2), (2, 4), (4, 6)]
    assert replica_rows(5, 0, 1) == (0, 5)
    # a micro-batch its replicas do not divide: tensor_split's shares, the first ones larger
    assert [replica_rows(6, k, 4) for k in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 6)]


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(list(params), lr=0.1, momentum=0.9)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(40 + step)
    # a shifted, scaled input: running statistics move far from their start
    return torch.randn(ROWS, 3, 8, 8, generator=g) * 2 + 1, torch.randint(0, 10, (ROWS,),
                                                                          generator=g)


def _reference_step(model: nn.Module, buffers: list[dict[str, torch.Tensor]],
                    opt: torch.optim.Optimizer, loss_fn: Any, x: torch.Tensor,
                    y: torch.Tensor) -> float:
    """One training step as the pipeline defines it with ``DP`` replicas, in one process.

    Every replica ``k`` has its own copy of the buffers (``buffers[k]``: BatchNorm's
    running statistics) and shares the parameters. The batch is cut into ``M``
    micro-batches; replica ``k`` runs rows ``[k*b/DP, (k+1)*b/DP)`` of each one
    (``b`` rows), in micro-batch order, in train mode, on its own buffers. Each
    share's loss counts ``1 / (M x DP)``, their gradients add up, the optimizer
    steps once, and then every buffer is set to its mean over the replicas
    (integers: the floor of the mean; ``num_batches_tracked`` is equal on all).
    """
    loss = 0.0
    for k in range(DP):
        model.load_state_dict(buffers[k], strict=False)
        for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True):
            start, stop = (len(xm) * k // DP, len(xm) * (k + 1) // DP)
            part = loss_fn(model(xm[start:stop]), ym[start:stop]) / (M * DP)
            part.backward()
            loss += part.item()
        buffers[k] = {n: b.detach().clone() for n, b in model.named_buffers()}
    opt.step()
    opt.zero_grad()
    for name in buffers[0]:
        stacked = torch.stack([b[name] for b in buffers])
        mean = (stacked.sum(0) // DP if not stacked.is_floating_point()
                else stacked.sum(0) / DP)
        for b in buffers:
            b[name] = mean.clone()
    model.load_state_dict(buffers[0], strict=False)
    return loss


def test_batchnorm_statistics_are_averaged_over_replicas_as_one_process_does(
        tmp_path: Path) -> None:
    w = build("resnet", batch_size=ROWS, seed=0, image_size=8, widths=(4, 8))
    model, loss_fn = w.model, w.loss_fn
    reference = copy.deepcopy(model)
    opt = _sgd(list(reference.parameters()))
    buffers = [{n: b.detach().clone() for n, b in reference.named_buffers()}
               for _ in range(DP)]
    x, y = _batch(0)
    first, _ = microbatches(Workload(copy.deepcopy(model), (x,), y, loss_fn), M * DP)[0]
    plan = balanced_plan(capture(copy.deepcopy(model), first), ranks=4, microbatches=M, dp=DP)
    assert [len(r) for r in plan.placement] == [DP, DP]  # two stages, each on two ranks
    with orgel.pipeline(model, (x,), y, loss_fn, ranks=4, microbatches=M, plan=plan,
                        optimizer=_sgd, threads=1) as pipe:
        for s in range(3):
            x, y = _batch(s)
            loss = pipe.step((x,), y)
            assert loss == pytest.approx(_reference_step(reference, buffers, opt, loss_fn,
                                                         x, y), rel=1e-5)
        per_rank = pipe._ranks.call("state_dict")
        state = pipe.state_dict()
        saved = ckpt.state_dict(pipe.save(tmp_path))
        x, y = _batch(9)
        evaluated = pipe.evaluate((x,), y)
    # every replica holds the same statistics (what state_dict and checkpoints report)
    for name in state:
        held = [part[name] for part in per_rank if name in part]
        assert len(held) in (DP, 2 * DP), name  # a stage's replicas (a tied tensor: more)
        for t in held[1:]:
            assert torch.equal(t, held[0]), name
    expected = reference.state_dict()
    assert list(state) == list(expected)
    moved = [n for n in expected if n.endswith("running_mean")
             and not torch.allclose(expected[n], torch.zeros_like(expected[n]), atol=1e-2)]
    assert moved  # the statistics really moved away from their start
    for name, t in expected.items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(saved[name], state[name]), name  # the checkpoint: the same values
    # evaluation reads the averaged statistics on every replica
    reference.eval()
    with torch.no_grad():
        assert evaluated == pytest.approx(float(loss_fn(reference(x), y)), rel=1e-5)
