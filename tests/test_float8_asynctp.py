"""Float8 linears in the roofline and AsyncTP's overlap in the TP pricing.

The roofline's Float8 (orgel.profile.roofline's docstring): a linear's GEMMs at the
fp8 peak plus its casts as memory traffic, attention and the head untouched. AsyncTP
(orgel.costs.mesh's docstring): a collective costs what its linears do not hide,
never more than blocking.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from orgel.costs.blocks import BlockCosts
from orgel.costs.devices import DEVICES, DeviceError
from orgel.costs.mesh import TPSplit, ring_time, tp_costs
from orgel.graph import capture
from orgel.profile.roofline import Roofline, estimate_costs
from orgel.schedule.costs import Link

MIB = 1 << 20
INTRA = Link(latency=0.01, per_mib=0.1)
H100 = DEVICES["h100-80gb"]


class _Attention(torch.nn.Module):
    """q, k, v projections of one input, SDPA, an output projection, and a head."""

    def __init__(self, width: int, heads: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(width, width, bias=False)
                                          for _ in range(4))
        self.head = torch.nn.Linear(width, 2 * width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + self.o(a.transpose(1, 2).reshape(b, s, d)))


def _graph(width: int = 8192, tokens: int = 8192) -> object:
    with torch.device("meta"):
        model = _Attention(width).to(torch.bfloat16)
        x = torch.randn(1, tokens, width, dtype=torch.bfloat16, requires_grad=True)
    return capture(model, {"x": x})


def _node(graph: object, op: str, params: str = "") -> object:
    return next(n for n in graph.nodes.values()  # type: ignore[attr-defined]
                if n.op == op and (not params or any(params in p for p in n.params)))


def test_float8_halves_a_large_linears_gemms_and_adds_its_casts() -> None:
    graph = _graph()
    bf16, fp8 = Roofline(graph, H100), Roofline(graph, H100, float8=True)
    q = _node(graph, "linear", "q")
    f, b, w, _ = bf16.times(q)
    f8, b8, w8, kernels = fp8.times(q)
    # 8192 x 8192 x 8192 bf16: compute-bound, 1.1 TFLOP at 80% of 989.5 TFLOP/s
    assert f == pytest.approx(2 * 8192**3 / (989.5e12 * 0.8) * 1000)
    rate = H100.memory_gbs * 1e9 * H100.efficiency["elementwise"] / 1000  # bytes per ms
    x_bytes = w_bytes = 8192 * 8192 * 2
    # forward: the GEMM at twice the peak, the amax and cast passes over x and W
    assert f8 == pytest.approx(f / 2 + 2.5 * (x_bytes + w_bytes) / rate)
    assert w8 == pytest.approx(w / 2)  # the weight-gradient GEMM
    # backward: two GEMMs, dy's cast, transposed FP8 copies of W, dy and x
    assert b8 == pytest.approx(b / 2 + (2.5 * x_bytes + 3 * x_bytes) / rate)
    # at this size the casts take a third of the GEMM's time: 0.68 of bf16's forward
    assert f8 < 0.7 * f and kernels == 5
    # k and v read the same input: it is cast once, by the first reader
    k = _node(graph, "linear", "k")
    assert fp8.times(k)[0] == pytest.approx(f / 2 + 2.5 * w_bytes / rate)


def test_float8_leaves_attention_and_the_head_alone() -> None:
    graph = _graph(width=1024, tokens=4096)
    bf16, fp8 = Roofline(graph, H100), Roofline(graph, H100, float8=True)
    sdpa = _node(graph, "scaled_dot_product_attention")
    head = _node(graph, "linear", "head")
    # the CPU kernel the capture runs is not counted by FlopCounterMode: the capture
    # counts Q K^T and P V itself, the causal half skipped
    assert sdpa.flops == 2 * 4096 * 4096 * (128 + 128) * 8 // 2  # type: ignore[attr-defined]
    assert fp8.times(sdpa) == bf16.times(sdpa)
    assert fp8.times(head) == bf16.times(head)
    assert head.name not in fp8.fp8 and len(fp8.fp8) == 4  # type: ignore[attr-defined]
    # a block of large linears is faster (a small one waits on its kernels' launches)
    big = _graph(width=4096, tokens=16384)
    a, b = (estimate_costs(big, H100, blocks=2, float8=f8) for f8 in (False, True))
    assert sum(b.fwd) < 0.9 * sum(a.fwd) and b.meta["float8"] and not a.meta["float8"]


def test_float8_needs_an_fp8_peak() -> None:
    with pytest.raises(DeviceError, match="fp8"):
        Roofline(_graph(64, 16), DEVICES["a100-40gb"], float8=True)


def _table(column: float, row: float) -> BlockCosts:
    """One block: fwd 4, bwd 8 ms, all of it TP-split; two regions of 4 MiB outputs."""
    return BlockCosts(
        fwd=[4.0], bwd=[8.0], wgrad=[4.0], params=[64 * MIB], activations=[32 * MIB],
        output=[8 * MIB], temporary=[0], edges=[], link=INTRA, node_ranks=8,
        tp_split=[TPSplit(fwd=4.0, bwd=8.0, wgrad=4.0, params=64 * MIB,
                          activations=32 * MIB, allreduce=8 * MIB, regions=2, column=column,
                          row=row, column_ends=2)])


def test_async_tp_prices_max_of_the_linears_and_their_collective() -> None:
    # tp 4: an all-gather or reduce-scatter of a 4 MiB region is 3 ring steps of 1 MiB
    one = ring_time(INTRA, 4 * MIB, 4, steps=1)
    assert one == pytest.approx(3 * (0.01 + 0.1))
    c = _table(column=1.6, row=0.4)
    blocking = tp_costs(c, 4, sequence_parallel=True)
    overlapped = tp_costs(c, 4, sequence_parallel=True, async_tp=True)
    assert blocking.fwd[0] == pytest.approx(4 / 4 + 4 * one)
    # two all-gathers beside the columns (0.4 ms on a member), two reduce-scatters beside
    # the row (0.1 ms): each side takes max(linears, collectives) instead of the sum
    compute = 4 / 4 - 0.4 - 0.1
    assert overlapped.fwd[0] == pytest.approx(compute + max(0.4, 2 * one) + max(0.1, 2 * one))
    assert overlapped.bwd[0] == pytest.approx(8 / 4 + (2 * one - 0.4) + (2 * one - 0.1))
    # linears long enough hide the collectives whole
    hidden = tp_costs(_table(column=8.0, row=8.0), 4, sequence_parallel=True, async_tp=True)
    assert hidden.fwd[0] == pytest.approx(1.0) and hidden.bwd[0] == pytest.approx(2.0)
    assert overlapped.meta["async_tp"] and "async_tp" not in blocking.meta


@pytest.mark.parametrize(("column", "row"), [(0.0, 0.0), (0.3, 0.0), (2.0, 0.1), (9.0, 9.0)])
def test_async_tp_is_never_slower_than_blocking(column: float, row: float) -> None:
    c = _table(column, row)
    for tp in (2, 4, 8):
        blocking = tp_costs(c, tp, sequence_parallel=True)
        overlapped = tp_costs(c, tp, sequence_parallel=True, async_tp=True)
        assert overlapped.fwd[0] <= blocking.fwd[0] + 1e-12
        assert overlapped.bwd[0] <= blocking.bwd[0] + 1e-12
        assert overlapped.fwd[0] >= c.fwd[0] / tp - 1e-12  # the compute stays
    # a table without the linears' times (an older file) overlaps nothing
    old = tp_costs(_table(0.0, 0.0), 4, sequence_parallel=True, async_tp=True)
    assert old.fwd == tp_costs(_table(0.0, 0.0), 4, sequence_parallel=True).fwd


def test_async_tp_hides_the_fraction_it_is_given() -> None:
    # h in [0, 1]: the blocking time less h of what the linears could hide (torchtitan's
    # AsyncTP runs gained 1.04-1.16x where hiding it all prices 1.25x)
    c = _table(column=1.6, row=0.4)
    blocking = tp_costs(c, 4, sequence_parallel=True)
    whole = tp_costs(c, 4, sequence_parallel=True, async_tp=True)
    half = tp_costs(c, 4, sequence_parallel=True, async_tp=0.5)
    for field in ("fwd", "bwd"):
        b, w, h = getattr(blocking, field)[0], getattr(whole, field)[0], getattr(half, field)[0]
        assert w < b and h == pytest.approx((b + w) / 2)
    assert tp_costs(c, 4, sequence_parallel=True, async_tp=1.0).fwd == whole.fwd
    assert tp_costs(c, 4, sequence_parallel=True, async_tp=0.0).fwd == blocking.fwd
    assert half.meta["async_tp"] == 0.5
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        tp_costs(c, 4, sequence_parallel=True, async_tp=1.5)


def test_async_tp_needs_sequence_parallelism_and_round_trips() -> None:
    with pytest.raises(ValueError, match="sequence_parallel=True"):
        tp_costs(_table(1.0, 1.0), 4, async_tp=True)
    c = _table(1.0, 0.5)
    assert BlockCosts.from_dict(json.loads(json.dumps(c.to_dict()))).tp_split == c.tp_split
    assert c.scaled(2).tp_split[0] == dataclasses.replace(
        c.tp_split[0], fwd=8.0, bwd=16.0, wgrad=8.0, activations=64 * MIB,
        allreduce=16 * MIB, column=2.0, row=1.0)


def test_roofline_tp_split_holds_each_regions_linears() -> None:
    graph = _graph(width=1024, tokens=4096)
    costs = estimate_costs(graph, H100, blocks=1)
    roof = Roofline(graph, H100)
    (s,) = costs.tp_split
    # one region: q, k, v the columns, o the row (the head is no region)
    assert s.regions == 1 and s.column_ends == 1
    assert s.column == pytest.approx(sum(roof.times(_node(graph, "linear", p))[0]
                                         for p in ("q", "k", "v")))
    assert s.row == pytest.approx(roof.times(_node(graph, "linear", "o"))[0])
