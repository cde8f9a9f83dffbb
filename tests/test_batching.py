"""One rule for what is batched: the workload's, in validation, the reference and the runtime.

A tensor whose size along the batch dimension is the batch size is split into
micro-batches (and shared by a stage's replicas); every other input goes whole
to every micro-batch: a 0-dim temperature, and the inputs the user names in
``orgel.pipeline(..., replicated=[...])``, such as a table of 2 rows (whose first
dimension happens to divide the micro-batch count). The runtime used to chunk
every input tensor: the scalar crashed, and the table was silently cut in two.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from archzoo.check import balanced_check
from orgel.batching import (
    batch_size,
    micro_sizes,
    replica_rows,
    split_batch,
    split_microbatches,
)
from orgel.models import ZooWorkload
from orgel.workload import Workload, WorkloadError, validate_workload


class WithTables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, table: torch.Tensor,
                temperature: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x) + table.sum(0))  # table: (2, 8), not batched
        h = torch.tanh(self.b(h) / temperature)  # temperature: 0-dim
        return self.c(h)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _workload() -> ZooWorkload:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    inputs = (torch.randn(4, 8, generator=g), torch.randn(2, 8, generator=g), torch.tensor(1.5))
    return ZooWorkload(WithTables(), inputs, torch.randn(4, 2, generator=g), _mse)


def test_split_batch_cuts_only_what_has_the_batch_size() -> None:
    x, table, t = torch.randn(4, 8), torch.randn(2, 8), torch.tensor(1.5)
    assert batch_size((x, t)) == 4
    parts = split_batch((x, table, t), [2, 2], 0, 4)
    assert [tuple(p[0].shape) for p in parts] == [(2, 8), (2, 8)]
    assert all(p[1] is table and p[2] is t for p in parts)
    named = split_microbatches({"x": x, "table": torch.randn(4, 8)}, None, 2,
                               replicated=("table",))
    assert [tuple(p["table"].shape) for p, _ in named] == [(4, 8), (4, 8)]


def test_a_data_collators_batch_encoding_is_cut_and_told_apart_as_a_dict() -> None:
    """A Hugging Face collator's batch is a ``BatchEncoding`` (a mapping, not a dict, and no
    pytree node): cut as a dict into pieces of its own type (a closure reads ``piece.input_ids``),
    and fingerprinted by its tensors (a torchrun process's own batch is told apart)."""
    from transformers import BatchEncoding

    from orgel.batching import fingerprint, share, tensors_in

    batch = BatchEncoding({"input_ids": torch.arange(12).view(4, 3), "n": 3})
    pieces = split_batch(batch, [2, 2], 0, 4)
    assert [type(p).__name__ for p in pieces] == ["BatchEncoding"] * 2
    assert torch.equal(pieces[1].input_ids, batch["input_ids"][2:]) and pieces[1]["n"] == 3
    assert torch.equal(share(batch, 1, 2, 0, 4)["input_ids"], batch["input_ids"][2:])
    assert len(tensors_in([batch])) == 1 and batch_size(batch) == 4
    rolled = BatchEncoding({"input_ids": batch["input_ids"].roll(1, 0), "n": 3})
    assert fingerprint({"b": batch}, None) != fingerprint({"b": rolled}, None)
    assert fingerprint({"b": batch}, None) == fingerprint({"b": dict(batch)}, None)


def test_a_batch_that_does_not_divide_is_cut_as_tensor_split_in_whole_replica_rows() -> None:
    """A DataLoader's smaller last batch: ``torch.tensor_split``'s sizes; with replicas,
    micro-batch ``i`` is the ``unit`` pieces ``i * unit ...`` of the batch cut so into
    ``m * unit`` (replica ``k`` runs piece ``k`` of it); too few rows is refused, naming
    drop_last."""
    for rows, m in [(6, 4), (7, 3), (8, 4), (5, 5)]:
        assert micro_sizes(rows, m) == [len(p) for p in torch.arange(rows).tensor_split(m)]
    assert micro_sizes(6, 2, unit=2) == [4, 2]
    assert micro_sizes(12, 4, unit=2) == [4, 4, 2, 2]
    for rows, m, unit in [(7, 2, 2), (10, 4, 2), (11, 3, 3)]:
        pieces = [len(p) for p in torch.arange(rows).tensor_split(m * unit)]
        sizes = micro_sizes(rows, m, unit)
        assert sizes == [sum(pieces[i * unit:(i + 1) * unit]) for i in range(m)]
        shares = [stop - start for size in sizes
                  for start, stop in (replica_rows(size, k, unit) for k in range(unit))]
        assert shares == pieces
    for rows, m, unit in [(3, 4, 1), (6, 4, 2), (3, 2, 2)]:
        with pytest.raises(WorkloadError, match=f"batch of {rows} rows.*drop_last=True"):
            micro_sizes(rows, m, unit)
    x = torch.arange(6 * 3).reshape(6, 3)
    parts = split_microbatches({"x": x}, x[:, 0], 4)
    assert [tuple(p["x"].shape) for p, _ in parts] == [(2, 3), (2, 3), (1, 3), (1, 3)]
    assert torch.equal(torch.cat([t for _, t in parts]), x[:, 0])


def test_an_unmarked_table_is_refused_with_what_to_do() -> None:
    w = _workload()
    with pytest.raises(WorkloadError, match=r"replicated=\["):
        validate_workload(Workload(*w), 2)


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"dp": 2}], ids=["pipeline", "replicas"])
def test_unbatched_inputs_go_whole_to_every_microbatch_and_replica(options: dict) -> None:
    outcome = balanced_check("tables", _workload, replicated=("table",), **options)
    assert outcome.status == "exact", outcome.line() + outcome.trace[-2000:]


class BreakWithTable(nn.Module):
    """A table input (2 rows, not batched) and a graph break: several graphs are glued."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x) + table.sum(0))
        h = torch.relu(h) if h.mean().item() > 0 else torch.tanh(h)  # a graph break
        return self.b(h)


@pytest.mark.slow
def test_a_forward_of_several_graphs_gives_replicated_inputs_whole() -> None:
    from orgel.explicit.api import pipeline

    torch.manual_seed(0)
    model = BreakWithTable()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    x, table, y = (torch.randn(4, 8, generator=g), torch.randn(2, 8, generator=g),
                   torch.randn(4, 2, generator=g))

    def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1)

    ref_opt = sgd(list(ref.parameters()))
    with pipeline(model, (x, table), y, _mse, ranks=2, microbatches=2, replicated=["table"],
                  optimizer=sgd, threads=1) as pipe:
        assert pipe.glue is not None  # several graphs
        losses = [pipe.step((x, table), y) for _ in range(2)]
        state = pipe.state_dict()
    for loss in losses:
        ref_opt.zero_grad()
        expected = 0.0
        for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True):
            part = _mse(ref(xm, table), ym) / 2
            part.backward()
            expected += part.item()
        ref_opt.step()
        assert loss == pytest.approx(expected, rel=1e-5)
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)
