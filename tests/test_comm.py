"""Messages derived from a Plan: which, where, in which order (comm.py contract)."""

from __future__ import annotations

import pytest

from orgel.schedule import Plan, PlanError, StageGraph
from orgel.schedule.comm import CommPlan, Message, derive_comm, describe
from orgel.schedule.families import build_schedule
from orgel.schedule.text import parse_schedule


def _plan(graph: StageGraph, placement: list[tuple[int, ...]], text: str,
          microbatches: int) -> Plan:
    schedule = parse_schedule(text)
    return Plan(graph, placement, len(schedule), microbatches, schedule)


def _short(comm: CommPlan) -> list[tuple[int, int, int, int, bool, int, int]]:
    return [(m.src_rank, m.dst_rank, m.edge, m.microbatch, m.grad, m.send_pos, m.recv_pos)
            for m in comm.messages]


def _check_indexes(comm: CommPlan) -> None:
    """Every message sits in its channel, sends_after and recvs_before, once."""
    for i, m in enumerate(comm.messages):
        assert comm.sends_after[m.src_rank][m.send_pos].count(i) == 1
        assert comm.recvs_before[m.dst_rank][m.recv_pos].count(i) == 1
        assert comm.channels[(m.src_rank, m.dst_rank)].count(i) == 1
    for (src, dst), indices in comm.channels.items():
        keys = [(comm.messages[i].send_pos, comm.messages[i].edge, comm.messages[i].part)
                for i in indices]
        assert keys == sorted(keys)
        assert all(comm.messages[i].src_rank == src and comm.messages[i].dst_rank == dst
                   for i in indices)
    assert sum(map(len, comm.channels.values())) == len(comm.messages)


def test_1f1b_two_ranks() -> None:
    plan = build_schedule("1f1b", 2, 3, nbytes=100)
    assert plan.schedule_text() == (
        "rank0: F0.0 F0.1 B0.0 F0.2 B0.1 B0.2\n"
        "rank1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2"
    )
    comm = derive_comm(plan)
    #        src dst edge mb grad send recv
    assert _short(comm) == [
        (0, 1, 0, 0, False, 0, 0),
        (0, 1, 0, 1, False, 1, 2),
        (0, 1, 0, 2, False, 3, 4),
        (1, 0, 0, 0, True, 1, 2),
        (1, 0, 0, 1, True, 3, 4),
        (1, 0, 0, 2, True, 5, 5),
    ]
    assert all(m.nbytes == 100 and m.part == (0, 1, 1) for m in comm.messages)
    assert comm.channels == {(0, 1): [0, 1, 2], (1, 0): [3, 4, 5]}
    assert comm.sends_after[0] == [[0], [1], [], [2], [], []]
    assert comm.recvs_before[0] == [[], [], [3], [], [4], [5]]
    _check_indexes(comm)


def test_same_rank_edge_carries_no_message() -> None:
    graph = StageGraph.chain(3, nbytes=8)
    plan = _plan(graph, [(0,), (0,), (1,)], """
        rank0: F0.0 F1.0 B1.0 B0.0
        rank1: F2.0 B2.0
    """, 1)
    comm = derive_comm(plan)
    assert _short(comm) == [(0, 1, 1, 0, False, 1, 0), (1, 0, 1, 0, True, 1, 2)]
    _check_indexes(comm)


def test_split_backward_sends_after_i_and_receives_before_i() -> None:
    plan = _plan(StageGraph.chain(2), [(0,), (1,)], """
        rank0: F0.0 I0.0 W0.0
        rank1: F1.0 I1.0 W1.0
    """, 1)
    assert _short(derive_comm(plan)) == [(0, 1, 0, 0, False, 0, 0), (1, 0, 0, 0, True, 1, 1)]


def test_dag_fan_out_fan_in_and_loss_stage() -> None:
    # 0 -> {1, 2} -> 3, each stage on its own rank; stage 3 (no outgoing edge) is the loss.
    graph = StageGraph.from_edges(4, [(0, 1), (0, 2), (1, 3), (2, 3)], nbytes=4)
    plan = _plan(graph, [(0,), (1,), (2,), (3,)], """
        rank0: F0.0 B0.0
        rank1: F1.0 B1.0
        rank2: F2.0 B2.0
        rank3: F3.0 B3.0
    """, 1)
    comm = derive_comm(plan)
    assert _short(comm) == [
        (0, 1, 0, 0, False, 0, 0),  # F0 sends on edges 0 and 1, in edge order
        (0, 2, 1, 0, False, 0, 0),
        (1, 3, 2, 0, False, 0, 0),
        (1, 0, 0, 0, True, 1, 1),
        (2, 3, 3, 0, False, 0, 0),
        (2, 0, 1, 0, True, 1, 1),
        (3, 1, 2, 0, True, 1, 1),
        (3, 2, 3, 0, True, 1, 1),
    ]
    assert comm.recvs_before[3] == [[2, 4], []]  # the loss stage's B needs only its own F
    assert comm.recvs_before[0] == [[], [3, 5]]
    _check_indexes(comm)


def test_skip_edge_goes_straight_to_its_consumer() -> None:
    graph = StageGraph.from_edges(3, [(0, 1), (1, 2), (0, 2)])
    plan = build_schedule("gpipe", 3, 1, stage_graph=graph)
    assert [(m.src_rank, m.dst_rank, m.edge, m.grad) for m in derive_comm(plan).messages] == [
        (0, 1, 0, False), (0, 2, 2, False), (1, 2, 1, False), (1, 0, 0, True),
        (2, 1, 1, True), (2, 0, 2, True),
    ]


def test_data_parallel_stage_exchanges_row_overlaps() -> None:
    # stage 0 on 2 ranks, stage 1 on 3 ranks: parts = lcm(2, 3) = 6.
    graph = StageGraph.chain(2, nbytes=600)
    plan = _plan(graph, [(0, 1), (2, 3, 4)], """
        rank0: F0.0 B0.0
        rank1: F0.0 B0.0
        rank2: F1.0 B1.0
        rank3: F1.0 B1.0
        rank4: F1.0 B1.0
    """, 1)
    comm = derive_comm(plan)
    forward = [(m.src_rank, m.dst_rank, m.part, m.nbytes) for m in comm.messages if not m.grad]
    assert forward == [
        (0, 2, (0, 2, 6), 200), (0, 3, (2, 3, 6), 100),
        (1, 3, (3, 4, 6), 100), (1, 4, (4, 6, 6), 200),
    ]
    backward = [(m.src_rank, m.dst_rank, m.part, m.nbytes) for m in comm.messages if m.grad]
    assert backward == [
        (2, 0, (0, 2, 6), 200), (3, 0, (2, 3, 6), 100),
        (3, 1, (3, 4, 6), 100), (4, 1, (4, 6, 6), 200),
    ]
    assert describe(plan, comm.messages[1]) == (
        "activations of edge 0->1 micro-batch 0 rows [2/6, 3/6)"
    )
    _check_indexes(comm)


def test_data_parallel_replica_on_same_rank_is_local() -> None:
    # Both stages data-parallel over ranks 0 and 1: replica k of each shares rank k.
    plan = _plan(StageGraph.chain(2, nbytes=10), [(0, 1), (0, 1)], """
        rank0: F0.0 F1.0 B1.0 B0.0
        rank1: F0.0 F1.0 B1.0 B0.0
    """, 1)
    assert derive_comm(plan).messages == []


def test_channel_order_follows_sender_order() -> None:
    plan = build_schedule("1f1b", 4, 8, nbytes=1)
    comm = derive_comm(plan)
    _check_indexes(comm)
    for indices in comm.channels.values():
        recv = [comm.messages[i].recv_pos for i in indices]
        assert recv == sorted(recv)  # 1F1B receives in the same order it is sent


def test_message_without_receiver_is_an_error() -> None:
    plan = _plan(StageGraph.chain(2), [(0,), (1,)], """
        rank0: F0.0 F0.1 B0.0 B0.1
        rank1: F1.0 B1.0
    """, 2)
    with pytest.raises(PlanError, match=r"^rank 0 at position 1 \(F0.1\) sends activations of "
                       r"edge 0->1 to rank 1, but rank 1 never runs F1.1$"):
        derive_comm(plan)


def test_message_is_a_named_tuple() -> None:
    m = Message(0, 1, 0, 0, False, (0, 1, 1), 5, 0, 0)
    assert m.nbytes == 5 and m._fields[-2:] == ("send_pos", "recv_pos")
