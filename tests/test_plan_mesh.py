"""The mesh's cost model (tensor parallelism, FSDP sharding) and the planner's joint search.

Formulas are checked by hand on small synthetic tables (orgel.costs.mesh's
docstring); the simulator's FSDP pricing against its formula and the one-replica
pricing against the full simulation; the planner's choices where the answer is
known; ``orgel plan`` printing the mesh it chose.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from orgel.cli import main as cli_main
from orgel.costs.blocks import BlockCosts
from orgel.costs.mesh import TPSplit, ring_time, shard_costs, tp_costs
from orgel.costs.recompute import BlockRecompute
from orgel.plan.planner import InfeasibleError, plan
from orgel.plan.predict import replicated
from orgel.plan.replicated import replica_step
from orgel.schedule.costs import Link
from orgel.sim import simulate

MIB = 1 << 20
INTRA = Link(latency=0.01, per_mib=0.1)
INTER = Link(latency=0.02, per_mib=1.0)


def table(blocks: int = 2, *, split: bool = True, params: int = 64 * MIB,
          link: Link = INTRA, factor: float = 8.0, opt_ms: float = 0.0) -> BlockCosts:
    """``blocks`` equal blocks: fwd 4 ms, bwd 8 ms (wgrad 4), half of each TP-splittable."""
    return BlockCosts(
        fwd=[4.0] * blocks, bwd=[8.0] * blocks, wgrad=[4.0] * blocks,
        params=[params] * blocks, activations=[32 * MIB] * blocks,
        output=[8 * MIB] * blocks, temporary=[0] * blocks,
        edges=[(i, i + 1) for i in range(blocks - 1)], link=link, optimizer_factor=factor,
        node_ranks=8, node_link=INTER, step_overhead=0.0,
        optimizer_ms=[opt_ms] * blocks if opt_ms else [],
        tp_split=[TPSplit(fwd=2.0, bwd=4.0, wgrad=2.0, params=params // 2,
                          activations=16 * MIB, allreduce=8 * MIB, regions=2)] * blocks
        if split else [])


def test_tp_costs_divide_the_split_part_and_add_the_all_reduces() -> None:
    c = tp_costs(table(), 4)
    # two regions of 4 MiB each, ring over 4 ranks: 2 x 3 steps of 1 MiB
    comm = 2 * 2 * 3 * INTRA.time(MIB)
    assert ring_time(INTRA, 4 * MIB, 4, steps=2) == pytest.approx(6 * (0.01 + 0.1))
    assert c.fwd[0] == pytest.approx(4 - 2 + 2 / 4 + comm)
    assert c.bwd[0] == pytest.approx(8 - 4 + 4 / 4 + comm)
    assert c.wgrad[0] == pytest.approx(4 - 2 + 2 / 4)
    assert c.params[0] == 64 * MIB - 32 * MIB + 8 * MIB
    assert c.activations[0] == 32 * MIB - 16 * MIB + 4 * MIB
    assert c.node_ranks == 2  # pipeline ranks of 4 GPUs per 8-GPU node
    assert c.meta["tp"] == 4
    assert tp_costs(table(), 1) is not None and tp_costs(table(), 1).fwd == [4.0, 4.0]
    # scaling a TP'd table keeps the split consistent (rows double: times and bytes double)
    assert table().scaled(2).tp_split[0] == TPSplit(4.0, 8.0, 4.0, 32 * MIB, 32 * MIB,
                                                    16 * MIB, 2)


def test_sequence_parallelism_splits_what_the_regions_leave_whole() -> None:
    # the norms and residual adds on a slice of the sequence: the whole block's time and
    # activations divide, the collectives move the same bytes; a layer's checkpointed
    # input (the residual stream) divides only with it
    facts = [BlockRecompute(layer_kept=8 * MIB, layer_rebuilt=32 * MIB, layer_fwd=4.0)] * 2
    base = dataclasses.replace(table(), recompute=facts)
    c, sp = tp_costs(base, 4), tp_costs(base, 4, sequence_parallel=True)
    comm = 2 * 2 * 3 * INTRA.time(MIB)
    assert sp.fwd[0] == pytest.approx(4 / 4 + comm)
    assert sp.bwd[0] == pytest.approx(8 / 4 + comm)
    assert sp.activations[0] == 32 * MIB // 4
    assert sp.wgrad[0] == pytest.approx(2 / 4 + 2 / 4)  # the norms' weights on slices too
    assert sp.recompute[0].layer_kept == 2 * MIB and c.recompute[0].layer_kept == 8 * MIB
    assert c.recompute[0].layer_rebuilt == 32 * MIB * c.activations[0] // (32 * MIB)
    # a layer's forward run again takes its collectives again, with or without SP
    assert sp.recompute[0].layer_fwd == pytest.approx(sp.fwd[0])
    assert c.recompute[0].layer_fwd == pytest.approx(c.fwd[0])


def test_split_backward_halves_divide_with_sequence_parallelism() -> None:
    # the input half (a block's 8 ms backward less its 4 ms weight half: the region's 2 ms
    # and 2 ms of the rest) and the weight half (the region's 2 ms, 2 of the rest)
    base = dataclasses.replace(table(), split_input=[4.0, 4.0], split_weight=[4.0, 4.0])
    comm = 2 * 2 * 3 * INTRA.time(MIB)
    c, sp = tp_costs(base, 4), tp_costs(base, 4, sequence_parallel=True)
    assert c.split_input[0] == pytest.approx(2 + 2 / 4 + comm)
    assert c.split_weight[0] == pytest.approx(2 + 2 / 4)
    assert sp.split_input[0] == pytest.approx(2 / 4 + 2 / 4 + comm)  # was negative
    assert sp.split_weight[0] == pytest.approx(2 / 4 + 2 / 4)


def test_tp_costs_refuse_what_cannot_be_priced() -> None:
    with pytest.raises(ValueError, match="no tensor-parallel facts"):
        tp_costs(table(split=False), 2)
    with pytest.raises(ValueError, match="does not divide the 8 GPUs per node"):
        tp_costs(table(), 3)


def test_tp_split_round_trips_through_the_costs_file() -> None:
    c = table()
    back = BlockCosts.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back.tp_split == c.tp_split


def test_shard_costs_divide_the_optimizer_state_among_the_replicas() -> None:
    c = shard_costs(table(opt_ms=2.0), 4)
    # bf16 weights + grads stay whole (2 x params); 6 x params of fp32 state / 4
    assert c.optimizer_factor == pytest.approx(2 + 6 / 4)
    assert c.static_bytes(0) == int(64 * MIB * 3.5)
    assert c.optimizer_ms == [0.5, 0.5]


def _one_stage(shard: str, opt_ms: float = 0.0):
    """One block on one rank, two replicas, one micro-batch: the plan and its table."""
    c = table(1, opt_ms=opt_ms)
    return plan(c, 2, 1, dp=2, shard=shard, planner="uniform-layers"), c


def test_fsdp_step_is_gather_forward_backward_reduce_scatter() -> None:
    plain, c = _one_stage("none")
    sharded, _ = _one_stage("fsdp")
    assert plain.plan.shard == ["none"] and sharded.plan.shard == ["fsdp"]
    assert plain.plan.meta["mesh"] == {"pp": 1, "tp": 1, "dp": 2, "shard": "none",
                                       "sequence_parallel": False}
    # each replica computes half of the micro-batch; replicas 0 and 1 share a node
    compute = (4.0 + 8.0) / 2
    allreduce = 2 * 1 * INTRA.time(64 * MIB // 2)
    gather = scatter = 1 * INTRA.time(64 * MIB // 2)
    assert plain.step_time == pytest.approx(compute + allreduce)
    assert sharded.step_time == pytest.approx(gather + compute + scatter)
    # memory: bf16 params + grads whole, the rest halved
    assert max(sharded.sim.peak_memory) < max(plain.sim.peak_memory)
    assert sharded.plan.costs.stages[0].static_bytes == int(64 * MIB * (2 + 6 / 2))


def test_fsdp_priced_from_one_replica_matches_the_full_simulation() -> None:
    c = shard_costs(table(4), 2)  # the pipeline is searched on the sharded table
    found = plan(c.scaled(0.5), 2, 4, dp=1, planner="uniform-layers")
    full = replicated(found.plan, 2, c, None, "fsdp")
    assert full.shard == ["fsdp", "fsdp"]
    fast = replica_step(found.plan, full)
    assert fast is not None
    slow = simulate(full)
    assert fast[0] == pytest.approx(slow.step_time)
    assert list(fast[1]) == pytest.approx(slow.peak_memory)
    labels = {e.label for e in slow.timeline.events}
    assert any(lb.startswith("reduce-scatter") for lb in labels)


def test_fsdp_gathers_start_with_the_step_and_hide_behind_the_warm_up() -> None:
    """Each rank of a sharded stage gathers its weights from the step's start (the runtime's
    ``Sharding.begin``): the first stage's first forward waits for it, the second stage's
    gather is over before its input arrives."""
    c = table(4)
    found = plan(c, 4, 4, dp=2, shard="fsdp", planner="uniform-layers", memory=8 << 30)
    events = simulate(found.plan).timeline.events
    for rank, stage in ((0, 0), (1, 1), (2, 0), (3, 1)):
        mine = sorted((e for e in events if e.rank == rank), key=lambda e: e.start)
        gather = next(e for e in mine if e.label == f"gather s{stage}")
        first = next(e for e in mine if e.kind == "F")
        assert gather.start == 0.0 and first.start >= gather.end
        if stage == 0:
            assert first.start == pytest.approx(gather.end)  # nothing else to wait for
        else:  # waits for its input, which arrives after the gather is done
            arrival = max(e.end for e in events if e.label.startswith("act")
                          and e.label.endswith(f"mb0 ->r{rank}"))
            assert first.start == pytest.approx(arrival) and arrival > gather.end


def test_planner_shards_where_it_is_faster_or_the_only_fit() -> None:
    c = table(4)
    both = ("none", "fsdp")
    roomy = plan(c, 4, 4, dp=2, shard=both, planner="uniform-layers", memory=8 << 30)
    alone = {how: plan(c, 4, 4, dp=2, shard=how, planner="uniform-layers", memory=8 << 30)
             for how in both}
    # both fit: the faster. FSDP's gathers start with the step (the second stage's hides
    # behind the first's forwards), its reduce-scatter is half an all-reduce, and each
    # replica steps the optimizer over half the state: here FSDP is the faster
    assert alone["fsdp"].step_time < alone["none"].step_time
    assert roomy.plan.shard == ["fsdp", "fsdp"]
    assert roomy.step_time == pytest.approx(alone["fsdp"].step_time)
    # 2 blocks per stage x 64 MiB x 8 = 1 GiB of state unsharded, 640 MiB sharded over 2
    tight = plan(c, 4, 4, dp=2, shard=both, planner="uniform-layers", memory=900 * MIB)
    assert tight.plan.shard == ["fsdp", "fsdp"]
    assert tight.plan.meta["mesh"]["shard"] == "fsdp"
    assert max(tight.sim.peak_memory) <= 900 * MIB
    with pytest.raises(InfeasibleError):
        plan(c, 4, 4, dp=2, shard="none", planner="uniform-layers", memory=900 * MIB)


def test_planner_picks_tensor_parallelism_when_it_is_faster() -> None:
    whole = [TPSplit(fwd=4.0, bwd=8.0, wgrad=4.0, params=64 * MIB, activations=32 * MIB,
                     allreduce=8 * MIB, regions=2)] * 2  # every block split in full
    c = dataclasses.replace(table(2, link=Link(latency=0.001, per_mib=0.001)), tp_split=whole)
    got = plan(c, 2, 2, tp=(1, 2), planner="uniform-layers")
    # tp 1: a 2-stage pipeline, (2 + 1) x 12 ms; tp 2: one pipeline rank, 2 x 2 x 6 ms + comm
    assert got.plan.tp == 2 and got.plan.num_ranks == 1 and got.plan.world_size == 2
    assert got.plan.meta["mesh"] == {"pp": 1, "tp": 2, "dp": 1, "shard": "none",
                                     "sequence_parallel": True}
    assert got.plan.sequence_parallel  # as the search priced it
    assert got.step_time == pytest.approx(24 + 2 * 2 * 2 * 2 * 2 * 1 * c.link.time(2 * MIB))
    slow = dataclasses.replace(c, link=Link(latency=5.0, per_mib=10.0))  # all-reduces dominate
    assert plan(slow, 2, 2, tp=(1, 2), planner="uniform-layers").plan.tp == 1
    assert plan(c, 2, 2, tp="auto", planner="uniform-layers").plan.tp == 2


def test_orgel_plan_prints_the_mesh(tmp_path, capsys) -> None:
    path = tmp_path / "costs.json"
    table(4).save(path)
    code = cli_main(["plan", "--costs", str(path), "--ranks", "8", "--microbatches", "4",
                     "--tp", "auto", "--shard", "auto", "--dp", "auto", "--memory", "1GiB",
                     "--planner", "uniform-layers", "--out", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("mesh: "))
    saved = json.loads((tmp_path / "plan.json").read_text())
    tp = saved.get("tp", 1)
    assert f"x TP {tp} x" in line and "(8 GPUs)" in line


class _Ffn(torch.nn.Module):
    """Residual MLP blocks: norm, up (column), gelu, down (row), add: one region each."""

    def __init__(self, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(layers))
        self.ups = torch.nn.ModuleList(torch.nn.Linear(width, 4 * width) for _ in range(layers))
        self.downs = torch.nn.ModuleList(torch.nn.Linear(4 * width, width)
                                         for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, up, down in zip(self.norms, self.ups, self.downs, strict=True):
            x = x + down(torch.nn.functional.gelu(up(norm(x))))
        return x


def test_roofline_tp_split_follows_the_graphs_regions() -> None:
    from orgel.costs.devices import load_device
    from orgel.graph import capture
    from orgel.profile.roofline import estimate_costs

    with torch.device("meta"):
        model, x = _Ffn(), torch.randn(32, 64)
    graph = capture(model, {"x": x})
    costs = estimate_costs(graph, load_device("h100-80gb"), blocks=3, rows=32)
    splits = costs.tp_split
    # two regions, each all-reduced once each way: 4 ends, half a region per end
    assert sum(s.regions for s in splits) == pytest.approx(2)
    # each region's output: 32 x 64 fp32 values
    assert sum(s.allreduce for s in splits) == 2 * 32 * 64 * 4
    # split weights: up's weight and bias, down's weight (its bias stays whole)
    assert sum(s.params for s in splits) == 2 * (64 * 256 + 256 + 256 * 64) * 4
    assert all(s.fwd <= f and s.params <= p for s, f, p
               in zip(splits, costs.fwd, costs.params, strict=True))
    two = tp_costs(costs, 2)
    assert sum(two.params) == sum(costs.params) - sum(s.params for s in splits) // 2


@pytest.mark.parametrize(("memory", "link"), [(None, INTRA),
                                               (1 << 30, Link(latency=0.5, per_mib=2.0))])
def test_mesh_shortlist_keeps_the_mesh_the_exhaustive_search_picks(memory, link) -> None:
    # 12 blocks on 16 GPUs: 13 meshes (TP 1-8, every dp, FSDP or not). In the roomy case
    # the quick plans are far from the searched ones (PP 4 x DP 4: 391 ms quick, 174 ms
    # searched), and a shortlist of one (mesh_top=1) ends at PP 8 x TP 2, 230 ms; the
    # tight case needs FSDP
    c = table(12, link=link)
    kwargs: dict = dict(tp="auto", shard="auto", dp=None, memory=memory)
    exhaustive = plan(c, 16, 8, mesh_top=None, **kwargs)
    screened = plan(c, 16, 8, **kwargs)
    assert screened.plan.meta["mesh"] == exhaustive.plan.meta["mesh"]
    assert screened.step_time == pytest.approx(exhaustive.step_time)
    assert screened.evaluations < exhaustive.evaluations


def test_quick_step_prices_a_plain_plan_and_shortlist_orders_by_it() -> None:
    from orgel.plan.screen import QUICK_TEMPLATES, compute_bound, quick_step, shortlist

    c = table(4)
    quick = quick_step(c, 2, 4, dp=2, templates=QUICK_TEMPLATES[:1])
    searched = plan(c, 4, 4, dp=2, planner="uniform-time")  # the same plan: 1F1B, time split
    assert quick == pytest.approx(searched.step_time)
    assert quick_step(c, 2, 4, dp=2) <= quick  # interleaved tried too
    # the proven bound: the average rank's compute, 4 micro-batches x 4 blocks x 12 ms / 2
    # replicas / 2 ranks
    assert compute_bound(c, 2, 4, dp=2) == pytest.approx(4 * 4 * 12 / 2 / 2)
    assert compute_bound(c, 2, 4, dp=2) <= quick
    assert quick_step(c, 2, 4, dp=2, memory=MIB) == float("inf")
    assert quick_step(c, 8, 4) == float("inf")  # deeper than the blocks
    inf = float("inf")
    assert shortlist("abcde", [5.0, 1.0, inf, 1.04, 3.0], top=1) == ["b", "d"]  # within 5%
    assert shortlist("abc", [3.0, 1.0, 2.0], top=2, slack=0.0) == ["b", "c"]
    assert shortlist("ab", [inf, inf]) == ["a", "b"]  # none fits quickly: search them all


def test_quick_plan_recomputes_per_layer_where_whole_stages_do_not_fit() -> None:
    """A stage recomputed whole rebuilds all its layers' activations at once for its
    backward, per layer one layer's: under a cap between the two peaks the quick plan
    fits by checkpointing layers (the 405B mesh rows' interleaved plans needed it)."""
    from orgel.plan.scorer import Scorer
    from orgel.plan.screen import QUICK_TEMPLATES, quick_plan
    from orgel.plan.splits import balanced_points, time_weights
    from orgel.plan.templates import cached_template

    # "selective" keeps the matmul outputs, most of a block here: it does not fit the cap
    facts = BlockRecompute(layer_kept=2 * MIB, layer_rebuilt=8 * MIB, layer_fwd=4.0,
                           selective_kept=14 * MIB, selective_rebuilt=2 * MIB,
                           selective_fwd=1.0)
    c = dataclasses.replace(table(4), recompute=[facts] * 4)
    scorer = Scorer(c)
    template = cached_template(scorer.templates, QUICK_TEMPLATES[0], 2, 4)
    points = balanced_points(time_weights(c), 2)
    peaks = {policy: max(scorer.score_chain(template, points, (policy,) * 2).peak_memory)
             for policy in (True, "layer")}
    assert peaks["layer"] < peaks[True]
    cap = int((peaks["layer"] + peaks[True]) / 2)
    step, p, _ = quick_plan(c, 2, 4, memory=cap, templates=QUICK_TEMPLATES[:1])
    assert p is not None and "layer" in p.recompute and step < float("inf")
    # without the layers' facts only whole stages can recompute: nothing fits
    assert quick_plan(dataclasses.replace(c, recompute=[]), 2, 4, memory=cap,
                      templates=QUICK_TEMPLATES[:1])[1] is None


def test_recompute_starts_from_the_best_policy_for_every_stage() -> None:
    """Relaxing stage by stage from every stage recomputed whole spends the memory on the
    first stages relaxed; where one policy for every stage fits, the planner's choice is
    never slower than it (Llama-3.1-405B on 1024 H100s: 7.8 against 6.1 s a step)."""
    from orgel.plan.scorer import Scorer
    from orgel.plan.screen import QUICK_TEMPLATES
    from orgel.plan.sequential import SequentialResult, _relax_recompute
    from orgel.plan.splits import balanced_points, time_weights
    from orgel.plan.templates import build_template

    facts = BlockRecompute(layer_kept=2 * MIB, layer_rebuilt=8 * MIB, layer_fwd=4.0,
                           selective_kept=12 * MIB, selective_rebuilt=8 * MIB,
                           selective_fwd=0.5)
    c = dataclasses.replace(table(8), recompute=[facts] * 8)
    template = build_template(QUICK_TEMPLATES[1], 2, 4)  # interleaved, 2 stages per rank
    assert template is not None
    points = balanced_points(time_weights(c), template.num_stages)
    free = Scorer(c)
    peaks = {policy: max(free.score_chain(template, points, (policy,) * 4).peak_memory)
             for policy in (False, "selective", True)}
    assert peaks[True] < peaks["selective"] < peaks[False]
    # a cap at which relaxing stage by stage from every stage whole gave the first two
    # stages none and left the third recomputing per layer (236.9 ms against 229.9)
    scorer = Scorer(dataclasses.replace(c, memory_per_rank=2310 * MIB))
    uniform = scorer.score_chain(template, points, ("selective",) * 4)
    whole = scorer.score_chain(template, points, (True,) * 4)
    assert uniform.feasible and uniform.step_time < whole.step_time
    result = _relax_recompute(scorer, SequentialResult(template, points, (True,) * 4, whole,
                                                       1, 1))
    assert result.score.feasible and result.score.step_time <= uniform.step_time + 1e-9


GPT_WORKLOAD = '''
from orgel.models.gpt import GPT, GPTConfig, lm_loss
from orgel.workload import Workload
import torch

def tiny():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=16))
    tokens = torch.randint(0, 64, (8, 16))
    return Workload(model, (tokens,), torch.roll(tokens, -1, 1), lm_loss)
'''


@pytest.mark.slow  # orgel plan profiles under contention: companion processes
def test_profiled_table_carries_tp_facts_and_plans_with_tp(tmp_path, cache, capsys) -> None:
    from orgel.graph.tensor_parallel import tp_regions
    from orgel.profile.workload import capture_workload, profile_graph
    from orgel.workload import load_workload

    path = tmp_path / "tiny.py"
    path.write_text(GPT_WORKLOAD)
    w, graph = capture_workload(load_workload(f"{path}:tiny"), 2)
    costs = profile_graph(w, graph, microbatches=2, blocks=6, link=False, repeats=2,
                          progress=False)
    regions = tp_regions(graph.graph_module)
    assert len(regions) == 4  # attention and MLP in each of the 2 layers
    region_bytes = 0
    for r in regions:  # the columns' weights and biases, the row's weight (its bias stays)
        bias = graph.attr_of.get(r.row_bias or "")
        region_bytes += sum(graph.tensor_bytes(p) for n in (*r.columns, r.row)
                            for p in graph.nodes[n].params if p != bias)
    assert sum(s.params for s in costs.tp_split) == region_bytes
    assert sum(s.regions for s in costs.tp_split) == pytest.approx(len(regions))
    # the measured times apportioned: a share of each block's, some in every layer
    assert all(s.fwd <= f and s.bwd <= b for s, f, b
               in zip(costs.tp_split, costs.fwd, costs.bwd, strict=True))
    assert sum(s.fwd > 0 for s in costs.tp_split) >= 2
    assert tp_costs(costs, 2).fwd != costs.fwd
    code = cli_main(["plan", f"{path}:tiny", "--ranks", "4", "--microbatches", "2",
                     "--blocks", "6", "--no-link", "--tp", "auto", "--max-loops", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert any(x.startswith("mesh: ") and "(4 GPUs)" in x for x in out.splitlines())
