"""Device models: meta capture, the roofline cost table, user JSON devices, node-aware links."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orgel.costs.blocks import BlockCosts
from orgel.costs.devices import DEVICES, DeviceError, device_from_dict, load_device
from orgel.graph import capture
from orgel.profile.roofline import Roofline, estimate_costs, op_class
from orgel.schedule.costs import Costs, Link


class MLP(torch.nn.Module):
    def __init__(self, width: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _graph(device: str, rows: int = 8) -> object:
    torch.manual_seed(0)
    with torch.device(device):
        model = MLP()
        x = torch.randn(rows, 64)
    return capture(model, {"x": x})


def test_meta_capture_matches_real_capture() -> None:
    real, meta = _graph("cpu"), _graph("meta")
    assert list(real.nodes) == list(meta.nodes)  # type: ignore[attr-defined]
    for name, node in real.nodes.items():  # type: ignore[attr-defined]
        other = meta.nodes[name]  # type: ignore[attr-defined]
        assert (node.shape, node.flops, node.nbytes) == (other.shape, other.flops, other.nbytes)
        # saved-for-backward bytes are counted per storage on meta too (not all 0)
        assert node.saved_bytes == other.saved_bytes
    assert meta.summary()["saved_bytes"] > 0  # type: ignore[attr-defined]


def test_roofline_times_follow_flops_and_bandwidth() -> None:
    graph = _graph("meta", rows=4096)
    a100 = load_device("a100-40gb")
    roof = Roofline(graph, a100)
    linear = next(n for n in graph.nodes.values() if n.op == "linear")  # type: ignore[attr-defined]
    fwd, bwd, wgrad, kernels = roof.times(linear)
    # fp32 matmul: 2*4096*64*64 FLOPs vs bytes moved; the larger bound wins
    compute = linear.flops / (19.5e12 * 0.9) * 1000
    memory = roof.traffic(linear) / (1555e9 * 0.8) * 1000
    assert fwd == pytest.approx(max(compute, memory))
    assert wgrad == pytest.approx(fwd) and kernels == 1
    # tf32 is faster only where compute bound; never slower
    assert Roofline(graph, a100, tf32=True).times(linear)[0] <= fwd
    first = graph.nodes["linear"]  # type: ignore[attr-defined]
    assert roof.times(first)[1] == pytest.approx(roof.times(first)[2])  # input needs no grad
    assert op_class("view") == "free" and op_class("layer_norm") == "normalization"
    assert op_class("scaled_dot_product_attention") == "attention"


def test_estimate_costs_is_a_block_table_the_planner_takes() -> None:
    graph = _graph("meta", rows=64)
    costs = estimate_costs(graph, load_device("h100-80gb"), blocks=4, rows=64)
    assert costs.num_blocks == 4 and costs.rows == 64
    assert sum(costs.params) == 4 * (64 * 64 + 64) * 4
    assert all(t > 0 for t in costs.fwd)
    assert all(w <= b for w, b in zip(costs.wgrad, costs.bwd, strict=True))
    assert costs.memory_per_rank == DEVICES["h100-80gb"].memory_bytes
    assert costs.node_ranks == 8 and costs.node_link == DEVICES["h100-80gb"].inter_node.link()
    again = BlockCosts.from_dict(json.loads(json.dumps(costs.to_dict())))
    assert (again.node_ranks, again.node_link) == (costs.node_ranks, costs.node_link)
    from orgel.plan import plan

    result = plan(costs, 2, 4)
    assert result.step_time > 0 and len(result.sim.peak_memory) == 2


def test_links_across_nodes_take_the_node_link() -> None:
    fast, slow = Link(0.01, 0.001), Link(0.02, 0.1)
    costs = Costs(stages=[], link=fast, node_ranks=8, node_link=slow)
    assert costs.link_between(0, 7) == fast and costs.link_between(7, 8) == slow
    costs.links = {(7, 8): fast}
    assert costs.link_between(7, 8) == fast  # a measured pair still wins
    assert Costs.from_dict(Costs(stages=[], link=fast, node_ranks=8,
                                 node_link=slow).to_dict()).node_link == slow


def test_data_parallel_allreduce_across_nodes_costs_the_inter_node_link() -> None:
    from orgel.plan import plan

    graph = _graph("meta", rows=64)
    device = load_device("a100-40gb")
    one_node = estimate_costs(graph, device, blocks=4, rows=64)
    spread = estimate_costs(graph, device, blocks=4, rows=64)
    spread.node_ranks = 2  # every replica on its own node
    spread.node_link = Link(latency=5.0, per_mib=50.0)  # a very slow network
    a = plan(one_node, 4, 4, dp=2, max_replicas=1, rows=64)
    b = plan(spread, 4, 4, dp=2, max_replicas=1, rows=64)
    assert b.step_time > a.step_time + 2 * 5.0


def test_user_json_device_and_errors(tmp_path: Path) -> None:
    data = DEVICES["a100-40gb"].to_dict()
    data["name"] = "mine"
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    assert load_device(str(path)).peak("bf16") == 312e12
    with pytest.raises(DeviceError, match="unknown device 'a100'"):
        load_device("a100")
    bad = dict(data, memory_gbs=-1)
    with pytest.raises(DeviceError, match="memory_gbs"):
        device_from_dict(bad)
    with pytest.raises(DeviceError, match="efficiency.matmul"):
        device_from_dict(dict(data, efficiency={"matmul": 1.5}))
    with pytest.raises(DeviceError, match="intra_node.gbs"):
        device_from_dict(dict(data, intra_node={"latency_us": 1}))
    with pytest.raises(DeviceError, match="unknown field"):
        device_from_dict(dict(data, colour="green"))
    path.write_text("{")
    with pytest.raises(DeviceError, match="not valid JSON"):
        load_device(str(path))


def test_plan_cli_with_a_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from orgel.cli import main

    workload = tmp_path / "w.py"
    workload.write_text(
        "import torch\n"
        "def workload():\n"
        "    with torch.device('meta'):\n"
        "        m = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])\n"
        "        x, y = torch.empty(64, 256), torch.empty(64, 256)\n"
        "    return m, (x,), y, torch.nn.functional.mse_loss\n")
    code = main(["plan", f"{workload}:workload", "--device", "v100-16gb", "--ranks", "2",
                 "--microbatches", "4", "--blocks", "8", "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_ranks"] == 2 and summary["step_time"] > 0
    assert main(["plan", f"{workload}:workload", "--device", "tpu", "--ranks", "2",
                 "--microbatches", "4"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err


def test_more_ranks_than_the_default_blocks_plan_one_stage_each() -> None:
    """40 layers on 36 ranks: the blocks follow the ranks asked for (it was refused with
    "36 ranks but only 32 blocks")."""
    from orgel.plan.device import plan_on_device
    from orgel.workload import Workload

    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64),
                                                          torch.nn.ReLU()) for _ in range(40)])
        x = torch.empty(16, 64)
    result = plan_on_device(Workload(model, (x,), x, torch.nn.functional.mse_loss),
                            "h100-80gb", ranks=36, microbatches=8, dp=1)
    assert result.plan.num_ranks == 36
    assert result.plan.num_stages >= 36
    assert result.plan.meta["block_graph"]["target_blocks"] == 72


class _Positions(torch.nn.Module):
    """Adds position numbers made without naming a device, as some forwards do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.arange(x.shape[-1]).to(x.dtype)


def test_a_meta_capture_whose_forward_makes_tensors_on_the_default_device() -> None:
    """The meta capture runs without torch.device("meta") around it (Dynamo traces that
    mode's hook at every call: slow on deep models); a forward that makes a tensor without
    naming a device is captured again inside it, with the same ops."""
    from orgel.plan.device import capture_meta
    from orgel.workload import Workload

    with torch.device("meta"):
        plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        positions = _Positions()
        x = torch.empty(4, 8)
    _, graph = capture_meta(Workload(plain, (x,), x, torch.nn.functional.mse_loss), 2)
    assert any("relu" in str(n.op) for n in graph.nodes.values())
    _, graph = capture_meta(Workload(positions, (x,), x, torch.nn.functional.mse_loss), 2)
    assert any("arange" in str(n.op) for n in graph.nodes.values())


def test_plan_on_a_table_of_one_block_per_layer(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``--blocks layers``: every cut between two layers (the embedding and the head
    blocks of their own), as the at-scale rows plan (their MFU rose where FLOP-balanced
    blocks cut inside the layers)."""
    from orgel.cli import main
    from orgel.graph.blocks import layer_blocks, layer_of
    from orgel.plan.device import capture_meta, device_costs

    workload = tmp_path / "w.py"
    workload.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.embed = torch.nn.Linear(64, 128)\n"
        "        self.layers = torch.nn.ModuleList(torch.nn.Sequential(\n"
        "            torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))\n"
        "            for _ in range(6))\n"
        "        self.head = torch.nn.Linear(128, 8)\n"
        "    def forward(self, x):\n"
        "        x = self.embed(x)\n"
        "        for layer in self.layers:\n"
        "            x = x + layer(x)\n"
        "        return self.head(x)\n"
        "def workload():\n"
        "    with torch.device('meta'):\n"
        "        m = M()\n"
        "        x, y = torch.empty(64, 64), torch.empty(64, 8)\n"
        "    return m, (x,), y, torch.nn.functional.mse_loss\n")
    costs = device_costs(f"{workload}:workload", "h100-80gb", microbatches=4, blocks="layers")
    assert costs.num_blocks == 6 + 2
    _, opgraph = capture_meta(f"{workload}:workload", 4)
    found = [{layer_of(opgraph.nodes[n].module) for n in names}
             for names in (b.nodes for b in layer_blocks(opgraph).blocks)]
    assert found[0] == {None} and found[-1] <= {None, "layers.5"}
    assert [f - {None} for f in found[1:-1]] == [{f"layers.{i}"} for i in range(6)]
    with pytest.raises(ValueError, match="'layers'"):
        device_costs(f"{workload}:workload", "h100-80gb", microbatches=4, blocks="rows")
    assert main(["plan", f"{workload}:workload", "--device", "h100-80gb", "--ranks", "4",
                 "--microbatches", "4", "--blocks", "layers", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_ranks"] == 4
    assert main(["plan", f"{workload}:workload", "--ranks", "2", "--microbatches", "4",
                 "--blocks", "layers"]) == 2
    assert "--blocks layers needs --device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", f"{workload}:workload", "--device", "h100-80gb", "--blocks", "0"])
