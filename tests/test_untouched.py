"""``orgel.pipeline`` leaves the caller's model and torch's global state exactly as it found them.

Capture, measurement and profiling run the model in train mode; before
:func:`orgel.guard.untouched` every BatchNorm model came back from
``orgel.pipeline`` with moved running statistics and ``num_batches_tracked``
at 7, and the pipelined training started from them.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from archzoo.check import changes, orgel_check, snapshot
from orgel.guard import untouched
from orgel.models import ZooWorkload
from test_glue import GradOffGraph


def _conv_bn() -> ZooWorkload:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for cin in (3, 8, 8):
        layers += [nn.Conv2d(cin, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True)]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    g = torch.Generator().manual_seed(0)
    return ZooWorkload(model, (torch.randn(4, 3, 8, 8, generator=g),),
                       torch.randint(0, 10, (4,), generator=g), _ce)


def _ce(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target)


@pytest.mark.slow
def test_batchnorm_model_is_untouched_and_its_statistics_match_one_process() -> None:
    outcome = orgel_check("conv_bn", _conv_bn)  # snapshot before/after, then one step
    assert outcome.status == "exact", outcome.line()
    assert outcome.worst["1.num_batches_tracked"] == 0.0  # each micro-batch counted once
    assert outcome.worst["1.running_mean"] <= 1e-6


def test_untouched_puts_back_buffers_modes_grads_and_rng() -> None:
    w = _conv_bn()
    w.model[0].weight.grad = torch.ones_like(w.model[0].weight)
    before = snapshot(w.model)
    with untouched(w.model):
        w.model.eval()
        w.model[0].weight.requires_grad_(False)
        w.model.train()
        _ce(w.model(*w.inputs), w.targets).backward()
        torch.rand(3)
    assert changes(before, snapshot(w.model)) == []


def test_untouched_undoes_an_exception_half_way() -> None:
    """A failure inside a vmap with grad off must not poison torch for the next call."""
    w = _conv_bn()
    before = snapshot(w.model)
    depth = torch._C._functorch.get_dynamic_layer_stack_depth()
    with pytest.raises(KeyError), untouched(w.model):
        w.model(*w.inputs)  # moves the BatchNorm statistics
        torch.set_grad_enabled(False)
        torch._C._functorch._vmap_increment_nesting(2, "error")
        raise KeyError("boom")
    assert torch.is_grad_enabled()
    assert torch._C._functorch.get_dynamic_layer_stack_depth() == depth
    assert changes(before, snapshot(w.model)) == []
    torch.randn(2)  # a random op outside vmap works again


def test_untouched_reports_a_parameter_changed_in_place() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="weight"), untouched(model), torch.no_grad():
        model.weight.mul_(2)


@pytest.mark.slow
def test_a_failed_pipeline_then_a_good_one_in_the_same_process() -> None:
    import orgel
    from orgel.graph import CaptureError

    torch.manual_seed(0)
    bad = GradOffGraph()  # fails half-way: under vmap, then a graph with gradients off
    x = torch.randn(4, 8)
    depth = torch._C._functorch.get_dynamic_layer_stack_depth()
    with pytest.raises(CaptureError, match=r"h\.sum(.|\n)*runs with gradients off"):
        orgel.pipeline(bad, (x,), torch.randn(4, 8), F.mse_loss, ranks=2, microbatches=2)
    assert torch.is_grad_enabled()
    assert torch._C._functorch.get_dynamic_layer_stack_depth() == depth
    outcome = orgel_check("conv_bn", _conv_bn)
    assert outcome.status == "exact", outcome.line()


@pytest.mark.slow
def test_recomputed_batchnorm_updates_its_statistics_once_per_microbatch() -> None:
    """A recomputed stage replays its forward; BatchNorm must not count the replay."""
    import dataclasses

    from orgel.graph import capture
    from orgel.plan.balanced import balanced_plan
    from orgel.workload import Workload, microbatches

    def plan_for(w: ZooWorkload) -> object:
        model = copy.deepcopy(w.model)
        first = microbatches(Workload(model, w.inputs, w.targets, w.loss_fn), 2)[0][0]
        plan = balanced_plan(capture(model, first), ranks=2, microbatches=2)
        return dataclasses.replace(plan, recompute=[True] * plan.num_stages)

    outcome = orgel_check("conv_bn_recompute", _conv_bn, plan_for=plan_for)
    assert outcome.status == "exact", outcome.line()
    assert outcome.worst["1.num_batches_tracked"] == 0.0
