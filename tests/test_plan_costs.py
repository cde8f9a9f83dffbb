"""The costs file and block cost table: parsing, defaults, clear errors, stage sums."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orgel.costs.blocks import BlockCosts, stage_costs, stage_graph
from orgel.costs.fields import CostsFileError

MiB = 1 << 20


def example() -> dict[str, object]:
    return {
        "blocks": [
            {"fwd": 1.2, "bwd": 2.4, "wgrad": 1.1, "params": 16 * MiB,
             "activations": 8 * MiB, "output": 4 * MiB},
            {"fwd": 1.0, "bwd": 2.0, "params": 0, "activations": 2 * MiB, "output": MiB,
             "temporary": 3 * MiB},
            {"fwd": 0.5, "bwd": 1.0, "output": MiB},
        ],
        "link": {"latency": 0.02, "per_mib": 0.05},
        "memory_per_rank": 80 << 30,
        "optimizer_factor": 4,
    }


def test_defaults_chain_and_wgrad(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(example()))
    bc = BlockCosts.load(path)
    assert bc.edges == [(0, 1), (1, 2)]
    assert bc.wgrad == [1.1, 1.0, 0.5]  # default: half of bwd
    assert bc.link.latency == 0.02 and bc.memory_per_rank == 80 << 30
    again = BlockCosts.from_dict(json.loads(json.dumps(bc.to_dict())))
    assert again.to_dict() == bc.to_dict()


def test_stage_costs_sum_blocks_and_map_optimizer_factor() -> None:
    bc = BlockCosts.from_dict(example())
    costs = stage_costs(bc, [[0, 1], [2]])
    first = costs.stages[0]
    assert first.fwd == pytest.approx(2.2) and first.bwd == pytest.approx(4.4)
    # The first stage computes no input gradient: its W is the whole backward.
    assert first.bwd_weight == pytest.approx(4.4)
    assert costs.stages[1].bwd_weight == pytest.approx(bc.wgrad[2])
    assert first.static_bytes == 4 * 16 * MiB
    assert first.activations == 10 * MiB and first.temporary == 3 * MiB
    assert costs.link.per_mib == 0.05 and costs.memory_per_rank == 80 << 30


def test_stage_graph_edge_bytes_from_producer_outputs() -> None:
    data = example()
    data["edges"] = [[0, 1], [0, 2], [1, 2]]
    bc = BlockCosts.from_dict(data)
    graph = stage_graph(bc, [[0], [1], [2]])
    bytes_by_pair = {(e.src, e.dst): e.nbytes for e in graph.edges}
    assert bytes_by_pair == {(0, 1): 4 * MiB, (0, 2): 4 * MiB, (1, 2): MiB}
    # Two consumers in one stage: block 0's output crosses once.
    merged = stage_graph(bc, [[0], [1, 2]])
    assert [(e.src, e.dst, e.nbytes) for e in merged.edges] == [(0, 1, 4 * MiB)]


@pytest.mark.parametrize("change,message", [
    (lambda d: d.pop("blocks"), "'blocks' must be a non-empty list"),
    (lambda d: d["blocks"][0].pop("fwd"), r"blocks\[0\] is missing 'fwd'"),
    (lambda d: d["blocks"][1].update(fwd="fast"), r"blocks\[1\].fwd must be a finite number"),
    (lambda d: d["blocks"][1].update(bwd=-1), r"blocks\[1\].bwd must not be negative"),
    (lambda d: d["blocks"][0].update(wgrad=9.0), r"exceeds bwd"),
    (lambda d: d["blocks"][0].update(flops=1), r"unknown field\(s\) \['flops'\]"),
    (lambda d: d.update(edges=[[0, 5]]), r"edge \[0, 5\] names a block outside 0..2"),
    (lambda d: d.update(edges=[[2, 1]]), r"goes backwards"),
    (lambda d: d.update(edges=[[0]]), r"edges\[0\] must be a pair"),
    (lambda d: d.update(link={"latency": 1, "bandwidth": 2}), r"link must be an object"),
    (lambda d: d.update(optimizer_factor=0.5), r"optimizer_factor must be >= 1"),
    (lambda d: d.update(extra=1), r"unknown field\(s\) \['extra'\]"),
])
def test_costs_errors_are_clear(change: object, message: str) -> None:
    data = example()
    change(data)  # type: ignore[operator]
    with pytest.raises(CostsFileError, match=message):
        BlockCosts.from_dict(data)


def test_load_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(CostsFileError, match="broken.json is not valid JSON"):
        BlockCosts.load(path)
    with pytest.raises(CostsFileError, match="cannot read costs file"):
        BlockCosts.load(tmp_path / "missing.json")
