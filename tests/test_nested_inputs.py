"""A forward that takes its inputs in containers (``forward(self, batch)`` reading
``batch["views"]``, a list): :mod:`orgel.nesting`. Trained through ``orgel.pipeline`` on
forked ranks (one graph, a graph break, FSDP replicas) against one process over the same
micro-batches; the paths (``batch.mask``) are the names ``replicated`` and ``batch_dim``
take; a key a path cannot name is refused with what to change."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import orgel
from orgel.nesting import call, flatten, nest


class ByBatch(torch.nn.Module):
    """Two views of an image and a mask the whole batch shares, in one dict."""

    def __init__(self, branch: bool = False) -> None:
        super().__init__()
        self.branch = branch
        self.enc = torch.nn.Linear(6, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        first, second = batch["views"]
        h = torch.tanh(self.enc(first)) + torch.tanh(self.enc(second)) * batch["mask"]
        if self.branch and h.mean().item() > 10.0:  # a graph break (never taken)
            h = h * 2
        return self.head(torch.relu(self.mix(h)))


def _batch(rows: int, seed: int) -> tuple[dict[str, Any], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    views = [torch.randn(rows, 6, generator=g), torch.randn(rows, 6, generator=g)]
    mask = (torch.rand(16, generator=g) > 0.3).float()  # one for every row
    return {"views": views, "mask": mask}, torch.randint(0, 3, (rows,), generator=g)


def _one_process(model: torch.nn.Module, batches: list[tuple[dict[str, Any], torch.Tensor]],
                 microbatches: int) -> list[float]:
    """SGD over each batch's micro-batches, as the pipeline's semantics: mean of their losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch, y in batches:
        total = 0.0
        for m in range(microbatches):
            part = {"views": [v.chunk(microbatches)[m] for v in batch["views"]],
                    "mask": batch["mask"]}
            loss = torch.nn.functional.cross_entropy(model(part), y.chunk(microbatches)[m])
            (loss / microbatches).backward()
            total += loss.item() / microbatches
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def test_paths_name_the_leaves_and_come_back_as_containers() -> None:
    a, b, m = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    flat = flatten({"batch": {"views": (a, b), "mask": m}, "use_cache": False})
    assert list(flat) == ["batch.views.0", "batch.views.1", "batch.mask", "use_cache"]
    again = nest(flat)
    assert again["batch"]["views"][0] is a and again["batch"]["views"][1] is b
    assert again["batch"]["mask"] is m and again["use_cache"] is False
    assert call(lambda batch, use_cache: batch["views"][1], flat) is b


@pytest.mark.slow
@pytest.mark.parametrize("branch,options", [(False, {}), (True, {}),
                                            (False, {"ranks": 4, "dp": 2, "shard": "fsdp"})],
                         ids=["one graph", "graph break", "fsdp replicas"])
def test_a_forward_taking_a_dict_of_tensors_trains_as_one_process(
        branch: bool, options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = ByBatch(branch)
    reference = copy.deepcopy(model)
    batches = [_batch(8, seed) for seed in range(2)] + [_batch(12, 2)]  # a larger last batch
    pipe = orgel.pipeline(model, (batches[0][0],), batches[0][1],
                          torch.nn.functional.cross_entropy, microbatches=2, schedule="1f1b",
                          replicated=["batch.mask"], **{"ranks": 2, **options},
                          optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    with pipe:
        losses = [pipe.step((x,), y) for x, y in batches]
        outputs = pipe.evaluate((batches[0][0],), outputs=True)
        pipe.copy_to(model)
    expected = _one_process(reference, batches, 2 * options.get("dp", 1))
    assert losses == pytest.approx(expected, rel=1e-6, abs=1e-7)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(outputs, reference.eval()(batches[0][0]),
                                   rtol=1e-6, atol=1e-6)


def test_a_key_a_path_cannot_name_is_refused_with_what_to_change() -> None:
    x = torch.zeros(4, 6)
    with pytest.raises(ValueError, match=r"input 'batch' is a dict with the key 'a\.b'.*rename"):
        orgel.pipeline(ByBatch(), ({"a.b": x},), torch.zeros(4, dtype=torch.long),
                       torch.nn.functional.cross_entropy, ranks=2)
