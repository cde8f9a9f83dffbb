"""Series-parallel decomposition of block DAGs."""

from __future__ import annotations

from orgel.plan.sp import Leaf, Parallel, Series, decompose


def test_chain_with_skip_edge_is_one_series() -> None:
    # A residual: 1 -> 2 -> 3 and 1 -> 3 is still a sequence of blocks.
    tree = decompose(5, [(0, 1), (1, 2), (2, 3), (3, 4), (1, 3)])
    assert tree == Series(tuple(Leaf(i) for i in range(5)))


def test_branches_become_parallel() -> None:
    edges = [(0, 1), (1, 2), (0, 3), (3, 4), (2, 5), (4, 5), (5, 6)]
    tree = decompose(7, edges)
    assert isinstance(tree, Series)
    assert tree.children[0] == Leaf(0) and tree.children[2:] == (Leaf(5), Leaf(6))
    par = tree.children[1]
    assert isinstance(par, Parallel)
    assert par.children == (Series((Leaf(1), Leaf(2))), Series((Leaf(3), Leaf(4))))


def test_separate_inputs_are_parallel() -> None:
    tree = decompose(3, [(0, 2), (1, 2)])
    assert tree == Series((Parallel((Leaf(0), Leaf(1))), Leaf(2)))


def test_non_series_parallel_piece_is_linearised() -> None:
    # The "N": 0->2, 0->3, 1->3 has no series cut and is connected.
    tree = decompose(4, [(0, 2), (0, 3), (1, 3)])
    assert isinstance(tree, Series) and tree.linearised
    assert tree.blocks == (0, 1, 2, 3)
