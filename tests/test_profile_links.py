"""Per-pair links: the fit, the benchmark over every ordered pair, the cache, and planning.

A slow rank pair must steer the planner: the scorer prices every message on the
link between the ranks it goes between, and renames a template's ranks so its
traffic avoids the slow pair; the plan it returns predicts what simulate() says.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from orgel.commands.profile import format_table
from orgel.costs.blocks import BlockCosts
from orgel.launch.errors import WorkerError
from orgel.launch.spawn import spawn
from orgel.plan import plan
from orgel.plan.predict import end_of_step
from orgel.plan.ranks import best_ranks, channel_traffic
from orgel.plan.scorer import Scorer, rename
from orgel.plan.templates import one_f_one_b
from orgel.profile import links as links_mod
from orgel.profile import workload
from orgel.profile.links import (
    _Bench,
    fit_link,
    link_from_round_trips,
    measure_link_samples,
    measure_links,
    ordered_pairs,
    summarize_links,
)
from orgel.schedule.comm import derive_comm
from orgel.schedule.costs import Link
from orgel.schedule.validate import validate
from orgel.sim import simulate

MiB = 1 << 20
FAST, SLOW = Link(0.01, 0.05), Link(2.0, 5.0)


# -- fitting -------------------------------------------------------------------------


def test_fit_recovers_a_line_and_relative_weights_favour_small_sizes() -> None:
    exact = [(1 << 10, 0.1 + 0.5 / 1024), (MiB, 0.6), (4 * MiB, 2.1)]
    for relative in (False, True):
        link = fit_link(exact, relative=relative)
        assert link.latency == pytest.approx(0.1) and link.per_mib == pytest.approx(0.5)
    # one noisy large sample: the relative fit keeps the small message's latency
    noisy = [(1 << 10, 0.1), (64 << 10, 0.13), (16 * MiB, 12.0)]
    assert abs(fit_link(noisy, relative=True).latency - 0.1) < abs(fit_link(noisy).latency - 0.1)
    assert fit_link([(1, 2.0), (MiB, 1.0)]).per_mib == 0.0  # noise never gives negative cost
    with pytest.raises(ValueError, match="two"):
        fit_link([(1, 1.0)])


def test_round_trips_give_the_one_way_link() -> None:
    # there and back: two latencies of 0.1 ms, the bytes one way at 0.5 ms/MiB
    samples = [(b, 0.2 + 0.5 * b / MiB) for b in (1 << 10, MiB, 4 * MiB)]
    link = link_from_round_trips(samples)
    assert link.latency == pytest.approx(0.1) and link.per_mib == pytest.approx(0.5)
    # a small message slowed down in every repeat cannot make the link look free
    hiccup = [(1 << 10, 3.0), (MiB, 0.7), (4 * MiB, 2.2)]
    assert link_from_round_trips(hiccup).per_mib > 0


def test_summary_keeps_only_pairs_that_differ_materially() -> None:
    same = {pair: Link(0.1 * (1 + 0.01 * k), 0.5) for k, pair in enumerate(ordered_pairs(3))}
    median, odd = summarize_links(same)
    assert odd == {} and median.per_mib == 0.5
    slow = dict(same)
    slow[(0, 1)] = SLOW
    median, odd = summarize_links(slow)
    assert odd == {(0, 1): SLOW} and median.per_mib == 0.5
    with pytest.raises(ValueError, match="measure"):
        summarize_links({})


# -- measuring -----------------------------------------------------------------------


@pytest.mark.slow  # spawns 3 gloo ranks
def test_every_ordered_pair_of_three_ranks_is_measured() -> None:
    # Three ranks share two cores: a 1 KiB round trip can take as long as 16 MiB
    # (every repeat descheduled), so the coefficients themselves are not checked;
    # only that each pair was measured and that moving 16 MiB is never free.
    samples = measure_link_samples(3, sizes=(1 << 10, 16 * MiB), repeats=5, timeout=30)
    assert sorted(samples) == [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]
    for pair, got in samples.items():
        assert [b for b, _ in got] == [1 << 10, 16 * MiB], pair
        assert all(ms > 0 for _, ms in got), f"{pair}: {got}"
        link = link_from_round_trips(got)
        assert link.latency >= 0 and link.per_mib >= 0, f"{pair}: {link}"
        # the fitted line does not undercut what 16 MiB actually took one way (a slower
        # 1 KiB round trip is a hiccup: it takes the 16 MiB time, see link_from_round_trips)
        assert link.time(16 * MiB) >= dict(got)[16 * MiB] / 2 - 1e-9, f"{pair}: {got}"


def stall(rank: int, world: int) -> None:
    """Rank 0 measures pair 0->1 while rank 1 never answers."""
    if rank == 0:
        _Bench(rank, torch.device("cpu"), timeout=1.0).round_trips((0, 1), 1 << 10, 1)
    else:
        time.sleep(2)


@pytest.mark.slow  # spawns 2 gloo ranks
def test_a_stalled_peer_times_out_naming_the_pair() -> None:
    with pytest.raises(WorkerError, match=r"pair 0->1 failed after at most 1 s"):
        spawn(stall, 2, timeout=10)  # the group's; the benchmark's own wait is 1 s


def test_measure_links_checks_its_options() -> None:
    with pytest.raises(ValueError, match="world"):
        measure_links(1)
    with pytest.raises(ValueError, match="backend"):
        measure_links(2, backend="mpi")
    with pytest.raises(ValueError, match="sizes"):
        measure_links(2, sizes=(MiB,))


def test_link_world_measures_what_the_host_has_devices_for() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    # gloo: as many processes as the plan has ranks, but never more than cores
    assert workload.link_world(cpu, 4, cores=16) == ("gloo", 4)
    assert workload.link_world(cpu, 4, cores=2) == ("gloo", 2)
    assert workload.link_world(cpu, 1, cores=16) == ("gloo", 2)  # a link needs two ends
    # CUDA: the runtime's NCCL links between the GPUs the plan will use
    assert workload.link_world(gpu, 4, gpus=8) == ("nccl", 4)
    assert workload.link_world(gpu, 16, gpus=8) == ("nccl", 8)
    # one GPU cannot hold a NCCL pair: the CPU processes' link is all there is
    assert workload.link_world(gpu, 4, gpus=1, cores=2) == ("gloo", 2)


def test_profiling_measures_the_links_of_the_planned_ranks(
        monkeypatch: pytest.MonkeyPatch, cache: Any) -> None:
    from test_profile import tiny

    asked: list[tuple[int, str]] = []

    def fake_links(*, ranks: int, backend: str, use_cache: bool) -> Any:
        asked.append((ranks, backend))
        return FAST, {(0, 2): SLOW}

    monkeypatch.setattr(workload, "link_costs", fake_links)
    monkeypatch.setattr(workload, "runtime_overhead", lambda link: (0.01, 0.1))
    monkeypatch.setattr(workload, "_cores", lambda: 3)
    costs = workload.profile_workload(tiny(), microbatches=2, blocks=3, repeats=1,
                                      progress=False, ranks=4, device="cpu")
    # 4 planned ranks on 3 cores: 3 gloo processes. Processes of one host talk over
    # loopback, every pair alike: a pair that measured slower measured noise, and is dropped
    assert asked == [(3, "gloo")]
    assert costs.link == FAST and costs.links == {}
    # between GPUs (NCCL) a pair can differ (NVLink or PCIe): the slow pair reaches the costs
    monkeypatch.setattr(workload, "link_world", lambda device, ranks: ("nccl", 3))
    costs = workload.profile_workload(tiny(), microbatches=2, blocks=3, repeats=1,
                                      progress=False, ranks=4, device="cpu")
    assert costs.link == FAST and costs.links == {(0, 2): SLOW}


def test_link_costs_caches_per_world_and_returns_only_odd_pairs(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("ORGEL_CACHE", str(tmp_path))
    calls: list[int] = []

    def fake(world: int, **_: Any) -> dict[tuple[int, int], Link]:
        calls.append(world)
        table = {pair: FAST for pair in ordered_pairs(world)}
        if world == 3:
            table[(1, 2)] = SLOW
        return table

    monkeypatch.setattr(links_mod, "measure_links", fake)
    assert workload.link_costs(ranks=2) == (FAST, {})
    assert workload.link_costs(ranks=3) == (FAST, {(1, 2): SLOW})
    assert workload.link_costs(ranks=3) == (FAST, {(1, 2): SLOW})  # from the cache
    assert calls == [2, 3]


def test_profile_table_shows_the_pairs_with_their_own_link() -> None:
    data = chain({(1, 2): SLOW}).to_dict()
    text = format_table(data)
    assert "default link 0.010 ms + 0.050 ms/MiB" in text
    assert "1->2 2.000 ms + 5.000 ms/MiB" in text
    assert "rank pairs" not in format_table(chain({}).to_dict())


# -- planning ------------------------------------------------------------------------


def chain(links: dict[tuple[int, int], Link], n: int = 12) -> BlockCosts:
    """Uniform blocks, 4 MiB between neighbours: messages matter on a slow link."""
    return BlockCosts(fwd=[1.0] * n, bwd=[2.0] * n, wgrad=[1.0] * n, params=[MiB] * n,
                      activations=[MiB] * n, output=[4 * MiB] * n, temporary=[0] * n,
                      edges=[(i, i + 1) for i in range(n - 1)], link=FAST, links=links)


def test_best_ranks_moves_traffic_off_the_slow_pair() -> None:
    traffic = np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]], dtype=float)  # a chain 0-1-2
    times = np.ones((3, 3)) - np.eye(3)
    assert best_ranks(traffic, times) == (0, 1, 2)  # a tie keeps the identity
    times[0, 1] = times[1, 0] = 10.0
    perm = best_ranks(traffic, times)
    assert {perm[0], perm[1]} != {0, 1} and {perm[1], perm[2]} != {0, 1}
    big = np.zeros((8, 8))  # pair swaps beyond 6 ranks
    for r in range(7):
        big[r, r + 1] = big[r + 1, r] = 1.0
    slow = np.ones((8, 8)) - np.eye(8)
    slow[3, 4] = slow[4, 3] = 10.0
    perm = best_ranks(big, slow)
    assert all({perm[r], perm[r + 1]} != {3, 4} for r in range(7))


def test_renamed_template_is_a_valid_plan_with_moved_ranks() -> None:
    t = one_f_one_b(3, 4)
    renamed = rename(t, (0, 2, 1))
    assert renamed.base.placement == [(0,), (2,), (1,)]
    assert renamed.base.schedule[2] == t.base.schedule[1]
    validate(renamed.base)
    assert channel_traffic(renamed.base)[0, 2] == 4  # 4 micro-batches of activations


@pytest.mark.parametrize("planner", ["beam", "auto"])
def test_planner_avoids_the_slow_pair_and_predicts_what_simulate_says(planner: str) -> None:
    slow = {(0, 1): SLOW, (1, 0): SLOW}
    fast_plan = plan(chain({}), 3, 4, planner=planner).plan
    assert (0, 1) in derive_comm(fast_plan).channels  # one link: ranks as the family puts them
    got = plan(chain(slow), 3, 4, planner=planner).plan
    channels = derive_comm(got).channels
    assert (0, 1) not in channels and (1, 0) not in channels
    sim = simulate(got)
    assert got.prediction is not None
    assert got.prediction["step_time"] == pytest.approx(
        sim.step_time + end_of_step(chain(slow), got))
    assert sim.step_time == pytest.approx(simulate(fast_plan).step_time)


def test_scorer_prices_the_slow_pair_where_messages_cross_it() -> None:
    t = one_f_one_b(3, 4)
    points = (4, 8)
    blocks = [range(0, 4), range(4, 8), range(8, 12)]
    fast = Scorer(chain({}), memory=None)
    slow_bc = chain({(0, 1): SLOW, (1, 0): SLOW})
    slow = Scorer(slow_bc, memory=None)
    # renamed around the slow pair: same step as with fast links everywhere
    assert slow.score_chain(t, points).step_time == pytest.approx(
        fast.score_chain(t, points).step_time)
    # forced over the slow pair: the scorer's step grows, exactly as simulate() says
    over = Scorer(slow_bc, memory=None, rename_ranks=False)  # stage 0 -> 1 crosses (0, 1)
    score = over.score_chain(t, points)
    forced = over.to_plan(t, blocks)
    assert forced.placement == [(0,), (1,), (2,)]
    assert score.step_time == pytest.approx(simulate(forced).step_time)
    assert score.step_time > fast.score_chain(t, points).step_time + 2 * SLOW.latency


def fan(links: dict[tuple[int, int], Link]) -> BlockCosts:
    """A stem, four branches of two blocks, a join: skip edges add channels."""
    n = 10
    edges = [(0, 1), (1, 2), (0, 3), (3, 4), (0, 5), (5, 6), (0, 7), (7, 8),
             (2, 9), (4, 9), (6, 9), (8, 9)]
    return BlockCosts(fwd=[1.0] * n, bwd=[2.0] * n, wgrad=[1.0] * n, params=[MiB] * n,
                      activations=[MiB] * n, output=[4 * MiB] * n, temporary=[0] * n,
                      edges=edges, link=FAST, links=links)


def test_graph_planner_renames_ranks_of_a_dag_of_stages() -> None:
    slow = {(0, 1): SLOW, (1, 0): SLOW}
    fast_plan = plan(fan({}), 4, 4, planner="graph").plan
    got = plan(fan(slow), 4, 4, planner="graph").plan
    assert (0, 1) in derive_comm(fast_plan).channels
    assert not {(0, 1), (1, 0)} & set(derive_comm(got).channels)
    assert got.prediction is not None and fast_plan.prediction is not None
    assert got.prediction["step_time"] == pytest.approx(
        simulate(got).step_time + end_of_step(fan(slow), got))
    assert got.prediction["step_time"] == pytest.approx(fast_plan.prediction["step_time"])


def test_a_slow_small_round_trip_never_undercuts_the_large_one() -> None:
    # 1 KiB took 3.9 ms (descheduled every time), 16 MiB 3.1 ms: both take 3.1
    hiccup = [(1 << 10, 3.9), (16 * MiB, 3.1)]
    link = link_from_round_trips(hiccup)
    assert link.per_mib == 0 and link.time(16 * MiB) == pytest.approx(3.1 / 2)
    fine = [(1 << 10, 0.2), (16 * MiB, 3.1)]
    assert link_from_round_trips(fine).time(16 * MiB) >= 3.1 / 2
