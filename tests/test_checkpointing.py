"""Recompute inside a stage: each layer checkpointed, or all but the costly operators.

What the forward of a stage keeps for its backward (the bytes still alive after it, counted
by :class:`orgel.profile.memory.LiveBytes`) under each policy of
:mod:`orgel.runtime.checkpointing`, and the gradients, which must not change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from orgel.graph import capture
from orgel.graph.blocks import layer_of, layer_runs
from orgel.graph.kept import kept_bytes
from orgel.plan.balanced import balanced_plan
from orgel.profile.memory import LiveBytes
from orgel.runtime.checkpointing import check_policy, checkpointed
from orgel.split import split_plan


class Stack(nn.Module):
    def __init__(self, layers: int = 4, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                          nn.LayerNorm(width)) for _ in range(layers))
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def test_a_layer_is_the_path_up_to_a_module_list_index() -> None:
    assert layer_of("model.layers.3.mlp.up_proj") == "model.layers.3"
    assert layer_of("encoder.blocks.12") == "encoder.blocks.12"
    assert layer_of("lm_head") is None and layer_of("") is None
    runs = layer_runs(["a", "b", "c", "d", "e"],
                      ["embed", "layers.0.fc", "layers.0.act", "layers.1.fc", "head"])
    assert runs == [(None, ["a"]), ("layers.0", ["b", "c"]), ("layers.1", ["d"]),
                    (None, ["e"])]


def test_policies_are_checked_with_what_to_give() -> None:
    assert check_policy("stage") is True and check_policy("layer") == "layer"
    with pytest.raises(ValueError, match="'selective'"):
        check_policy("blocks")


def _kept_and_grads(policy: bool | str) -> tuple[int, list[torch.Tensor], int]:
    """What the forward kept (measured), the gradients, and what the model predicted."""
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(32, 16)
    graph = capture(model, (x,))
    split = split_plan(graph, balanced_plan(graph, ranks=1, microbatches=1))
    stage = split.stages[0]
    run = checkpointed(stage.module, policy, stage.layers)
    with LiveBytes() as live:
        out = run(x)
        kept = live.now - out[0].numel() * out[0].element_size()  # the output is no keep
        out[0].sum().backward()
    predicted, _ = kept_bytes(graph, [n for _, run_ in stage.layers for n in run_], policy)
    return kept, [p.grad for p in stage.module.parameters()], predicted


def test_layer_and_selective_keep_less_and_compute_the_same_gradients() -> None:
    kept, grads, _ = _kept_and_grads(False)
    for policy in ("layer", "selective"):
        less, same, _ = _kept_and_grads(policy)
        assert less < 0.75 * kept, (policy, less, kept)
        assert all(torch.equal(a, b) for a, b in zip(grads, same, strict=True)), policy
    layer, _, _ = _kept_and_grads("layer")
    assert layer < 0.4 * kept  # four layers: their inputs, not their insides


def test_the_kept_bytes_model_matches_what_each_policy_keeps() -> None:
    """:func:`orgel.graph.kept.kept_bytes` from the capture's measured facts, against the
    bytes the forward left alive (LiveBytes), per policy."""
    for policy in (False, "layer", "selective"):
        measured, _, predicted = _kept_and_grads(policy)
        assert abs(predicted - measured) <= 0.2 * measured, (policy, predicted, measured)


@pytest.mark.slow
def test_orgel_run_with_layer_recompute_trains_as_one_process(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`orgel run --recompute layer --check` on 2 local ranks under ZB-H1 (a split backward
    recomputes each layer for its input half and again for its weight half)."""
    from orgel.cli import main

    code = main(["run", "examples/gpt.py:workload", "--ranks", "2", "--schedule", "zb-h1",
                 "--microbatches", "4", "--steps", "2", "--recompute", "layer", "--check",
                 "--optimizer", "adamw", "--lr", "1e-3", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "-> OK" in out


def _bf16_losses(policy: bool | str) -> list[float]:
    import orgel

    torch.manual_seed(0)
    model = Stack(layers=2, width=32)
    x, y = torch.randn(8, 16), torch.randn(8, 2)
    with orgel.pipeline(model, (x,), y, torch.nn.functional.mse_loss, ranks=2, microbatches=2,
                        precision="bf16-mixed", recompute=policy,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1)) as pipe:
        return [pipe.step((x,), y) for _ in range(3)]


@pytest.mark.slow
def test_layer_recompute_under_bf16_mixed_trains_as_without_it() -> None:
    """A checkpoint stopped early in its recompute left the graph's autocast region entered:
    autocast then kept the step's bfloat16 copies of the weights past the optimizer step,
    and the next steps trained on stale weights."""
    assert _bf16_losses("layer") == _bf16_losses(False)


def _parallel_training(policy: bool | str, **parallel: Any
                       ) -> tuple[list[float], dict[str, torch.Tensor]]:
    import orgel

    torch.manual_seed(0)
    model = Stack(layers=4, width=16)
    x, y = torch.randn(8, 16), torch.randn(8, 2)
    with orgel.pipeline(model, (x,), y, torch.nn.functional.mse_loss, ranks=4,
                        microbatches=2, schedule="1f1b", recompute=policy,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), **parallel) as pipe:
        assert list(pipe.plan.recompute) == [policy] * pipe.plan.num_stages
        if "tp" in parallel:
            assert any(pipe.call_ranks("tp_shards"))  # the MLPs are split over the members
        else:
            assert set(pipe.plan.shard) == {"fsdp"}
        losses = [pipe.step((x,), y) for _ in range(2)]
        return losses, pipe.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["layer", "selective"])
@pytest.mark.parametrize("parallel", [{"tp": 2}, {"dp": 2, "shard": "fsdp"}],
                         ids=["tp", "fsdp"])
def test_layer_and_selective_recompute_run_with_tp_and_fsdp(
        policy: str, parallel: dict[str, Any], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each layer's (or each costly op's) checkpoint calls the weights the stage computes
    with: the DTensor ones of the TP split (the runner made after the regions are split),
    or FSDP2's gathered ones (the stage gathered first, the runner made from them); each
    checkpoint runs (the forked ranks note each call in a file) and trains as without
    recompute."""
    from orgel.runtime import checkpointing

    calls = tmp_path / "checkpointed"
    forward = checkpointing._Checkpointed.forward

    def noted(self: Any, *args: Any) -> Any:
        with open(calls, "a") as f:
            f.write(".")
        return forward(self, *args)

    monkeypatch.setattr(checkpointing._Checkpointed, "forward", noted)
    losses, state = _parallel_training(policy, **parallel)
    assert calls.exists() and calls.read_text()  # the ranks ran checkpointed forwards
    want_losses, want = _parallel_training(False, **parallel)
    assert losses == want_losses
    for name, t in want.items():
        assert torch.equal(state[name], t), name


class _NormedLayers(nn.Module):
    """Residual layers with BatchNorm, whose forward updates running statistics in place."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU()) for _ in range(4))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


@pytest.mark.slow
@pytest.mark.parametrize(("policy", "compiled"), [("layer", False), ("selective", False),
                                                  ("layer", True)])
def test_layer_and_selective_recompute_update_batchnorm_statistics_once(
        policy: str, compiled: bool) -> None:
    """A stage whose forward updates buffers recomputes on copies of them as its forward
    found them: the running statistics and every weight after two steps are one process's
    (compiled: AOTAutograd applies the updates once; Inductor's fused kernels round
    otherwise, within compiled stages' tolerance)."""
    import orgel

    torch.manual_seed(0)
    model = _NormedLayers()
    reference = _NormedLayers()
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)
    loss_fn = nn.functional.mse_loss
    with orgel.pipeline(model, x, y, loss_fn, ranks=2, microbatches=2, schedule="1f1b",
                        recompute=policy, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        threads=1, compile=compiled) as pipe:
        assert set(pipe.plan.recompute) == {policy}
        losses = [pipe.step(x, y) for _ in range(2)]
        state = pipe.state_dict()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        loss = 0.0
        for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True):
            part = loss_fn(reference(xm), ym) / 2
            part.backward()
            loss += part.item()
        opt.step()
        assert losses[step] == pytest.approx(loss, rel=1e-5 if compiled else 1e-6)
    tol = {"rtol": 1e-5, "atol": 1e-6} if compiled else {"rtol": 1e-6, "atol": 1e-7}
    for name, want in reference.state_dict().items():
        torch.testing.assert_close(state[name], want, **tol, msg=name)  # type: ignore[arg-type]
