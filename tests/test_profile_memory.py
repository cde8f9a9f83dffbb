"""Memory measured per block: the backward's temporaries as a step's ``B`` holds them.

The block tests run what a rank runs for one micro-batch after the first (the
parameters' gradients already exist), tracked by :class:`LiveBytes`, and check
that the profile's ``activations + temporary`` (what the simulator charges a
running ``B``) covers its peak; the last one profiles, plans and runs a whole
step on one in-process rank and compares the predicted peak with the measured.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from orgel.profile.blocks import block_probe, loss_jobs
from orgel.profile.memory import LiveBytes
from orgel.split.types import StageModule

CPU = torch.device("cpu")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 32))


def later_microbatch_peak(module: nn.Module, x: torch.Tensor,
                          backward: Callable[[torch.Tensor], None]) -> int:
    """Peak live bytes of forward + backward once the gradients exist (not counted)."""
    backward(module(x.detach().requires_grad_(True)))  # micro-batch 0 makes the gradients
    leaf = x.detach().requires_grad_(True)
    with LiveBytes() as mode:
        backward(module(leaf))
        peak = mode.peak
    module.zero_grad(set_to_none=True)
    return peak


def test_backward_temporary_counts_each_new_weight_gradient() -> None:
    block = mlp()
    stage = StageModule(index=0, module=block, inputs=["x"], outputs=["y"])
    x = torch.randn(2, 32)
    probe = block_probe(stage, [x], CPU)
    grad = torch.randn(2, 32)  # arrives from the next stage (a receive buffer)
    peak = later_microbatch_peak(block, x, lambda y: y.backward(grad))
    # A new weight gradient is made and added into the existing one: the largest
    # weight's gradient is a temporary of the backward, on top of what it frees.
    assert probe.temporary >= 256 * 32 * 4
    assert probe.activations + probe.temporary >= peak
    assert all(p.grad is None for p in block.parameters())  # the probe leaves none behind


def test_loss_block_temporary_counts_the_loss_backward() -> None:
    torch.manual_seed(0)
    head = nn.Linear(8, 512, bias=False)  # logits over a 512-word vocabulary
    stage = StageModule(index=0, module=head, inputs=["h"], outputs=["logits"])
    h, targets = torch.randn(64, 8), torch.randint(0, 512, (64,))
    logits = 64 * 512 * 4

    def loss(outs: list[torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(outs[0], targets)

    probe = block_probe(stage, [h], CPU, loss=(loss, frozenset({0})))
    plain = block_probe(stage, [h], CPU)
    # What the loss keeps (log-softmax of the logits, its value) is counted apart,
    # as the loss's saved bytes; the temporary adds what the loss backward makes
    # during ``B``: the gradients of the log-probabilities and of the logits.
    split = SimpleNamespace(output_names=["logits"], unflatten_outputs=lambda outs: outs[0])
    _, loss_kept = loss_jobs(split, {"logits": head(h)}, lambda y, t: loss([y]), targets)
    assert loss_kept >= logits
    peak = later_microbatch_peak(head, h, lambda y: loss([y]).backward())
    assert probe.activations + loss_kept + probe.temporary >= peak
    assert probe.temporary >= 2 * logits > plain.temporary
    assert probe.activations == plain.activations


def test_loss_probe_checks_its_form() -> None:
    stage = StageModule(index=0, module=mlp(), inputs=["x"], outputs=["y"])
    with pytest.raises(ValueError, match="frozenset of output positions"):
        block_probe(stage, [torch.randn(2, 32)], CPU,
                    loss=(lambda outs: outs[0].sum(), {0}))  # type: ignore[arg-type]


def test_predicted_peak_covers_a_measured_step(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Profile, plan and run one rank; the prediction covers the step's peak, within 10%.

    The peak is the last ``B``: the loss backward's gradients and a weight's new
    gradient added into the one micro-batch 0 left (the profile once measured
    neither: predicted 73% of this step's peak).
    """
    from orgel.graph.capture import capture
    from orgel.plan import plan_workload
    from orgel.runtime.executor import Executor
    from orgel.split import split_plan
    from orgel.workload import Workload, microbatches, named_inputs

    monkeypatch.setenv("ORGEL_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 512))
    w = Workload(model, (torch.randn(256, 16),), torch.randint(0, 512, (256,)),
                 nn.functional.cross_entropy)
    result = plan_workload(w, ranks=1, microbatches=2, blocks=3, link=False, progress=False,
                           threads=1)
    plan = result.plan
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        split = split_plan(capture(model, named_inputs(model, microbatches(w, 2)[0][0])), plan)
        optimizers: list[torch.optim.Optimizer] = []

        def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
            optimizers.append(torch.optim.AdamW(params))
            return optimizers[-1]

        executor = Executor(plan, split, loss_fn=w.loss_fn, optimizer_factory=adamw)
        inputs = named_inputs(model, w.inputs)
        executor.step(inputs, w.targets)
        # Static bytes as the benchmark counts them: parameters and optimizer state;
        # the measured step makes (and counts) the gradients itself.
        static: dict[int, int] = {}
        for p in executor.parameters():
            p.grad = None
            static[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
        for state in optimizers[0].state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    static[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
        with LiveBytes() as mode:
            executor.step(inputs, w.targets)
        measured = sum(static.values()) + mode.peak
    finally:
        dist.destroy_process_group()
    predicted = result.sim.peak_memory[0]
    assert measured <= predicted <= 1.1 * measured
