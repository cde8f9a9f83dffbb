"""One rank holding the whole model (the throughput benchmarks' orgel rows): without
clipping or loss scaling its step leaves the loss and the gradient norm on the device until
the optimizer has stepped (on a GPU, no wait between the backward and the optimizer), and
reports them and trains as one process does."""

from __future__ import annotations

import copy

import pytest
import torch

import orgel
from orgel.models import build

pytestmark = pytest.mark.slow


def test_one_rank_reports_the_loss_and_norm_of_one_process() -> None:
    w = build("gpt", batch_size=4, seed=0)
    reference = copy.deepcopy(w.model)

    def opt(params: object) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2)  # type: ignore[arg-type]

    with orgel.pipeline(w.model, w.inputs, w.targets, w.loss_fn, ranks=1, microbatches=1,
                        schedule="gpipe", optimizer=opt) as pipe:
        got = []
        for _ in range(3):
            loss = pipe.step(w.inputs, w.targets)
            got.append((loss, pipe.grad_norm))
        state = pipe.state_dict()
    ref_opt = opt(reference.parameters())
    want = []
    for _ in range(3):
        loss = w.loss_fn(reference(*w.inputs), w.targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
        ref_opt.step()
        ref_opt.zero_grad()
        want.append((loss.item(), norm.item()))
    for (loss, norm), (ref_loss, ref_norm) in zip(got, want, strict=True):
        assert abs(loss - ref_loss) <= 1e-6 * max(1.0, abs(ref_loss)), (got, want)
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (got, want)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)
