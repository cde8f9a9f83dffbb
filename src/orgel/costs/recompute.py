"""What each recompute policy keeps, rebuilds and runs again: per block, per stage, per plan.

The policies are :data:`orgel.schedule.ir.RECOMPUTE`'s, run by
:mod:`orgel.runtime.checkpointing`, with their bytes from the capture, by the rules of
:mod:`orgel.graph.kept`:

* ``True`` (the stage whole): it keeps its inputs; its backward rebuilds all its
  activations at once and runs its whole forward again;
* ``"layer"`` (torchtitan's, Megatron's and DeepSpeed's full activation checkpointing):
  it keeps each layer's inputs (and what nodes outside every layer save); its backward
  rebuilds one layer at a time and runs the layers' forward again;
* ``"selective"`` (torchtitan's op-level SAC): it keeps its inputs and the outputs of the
  matmuls and attention; its backward rebuilds the rest and runs the cheap ops again.

A block's facts (:class:`BlockRecompute`) come from its captured nodes
(:func:`orgel.profile.recompute.block_facts`); the forward a policy runs again is the
block's forward time (measured or estimated) times the share its recomputed nodes take
of the block's roofline time. A stage adds its blocks' facts
up (:func:`stage_policies`) into :class:`~orgel.schedule.costs.PolicyCost` entries of its
:class:`~orgel.schedule.costs.StageCost`; the simulator and the planner read them
through :func:`policy_effects`. A table without these facts (an older costs file)
prices ``"layer"`` and ``"selective"`` as ``True``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from orgel.costs.fields import read_numbers
from orgel.schedule.costs import PolicyCost

#: the integer fields of :class:`BlockRecompute` (bytes); the others are ms
_BYTES = ("layer_kept", "layer_rebuilt", "selective_kept", "selective_rebuilt")
_KEYS = (*_BYTES, "layer_fwd", "selective_fwd")


@dataclass(frozen=True)
class BlockRecompute:
    """One block's facts for ``"layer"`` and ``"selective"`` recompute (one micro-batch).

    ``layer_kept``: bytes ``"layer"`` keeps of the block (its layers' inputs, what nodes
    outside every layer save); ``layer_rebuilt``: the largest layer's saved bytes (the
    backward rebuilds one at a time); ``layer_fwd``: ms of the layers' forward run again.
    ``selective_kept``: bytes of the outputs ``"selective"`` keeps (matmuls, attention;
    the stage's inputs are counted by the stage); ``selective_rebuilt``: the saved bytes
    it rebuilds; ``selective_fwd``: ms of the ops it runs again.
    """

    layer_kept: int = 0
    layer_rebuilt: int = 0
    layer_fwd: float = 0.0
    selective_kept: int = 0
    selective_rebuilt: int = 0
    selective_fwd: float = 0.0

    def scaled(self, factor: float) -> BlockRecompute:
        """For micro-batches ``factor`` times as large."""
        return BlockRecompute(**{k: (int(getattr(self, k) * factor) if k in _BYTES
                                     else getattr(self, k) * factor) for k in _KEYS})

    def tp_member(self, nbytes: float, ms: float, *,
                  sequence_parallel: bool = False) -> BlockRecompute:
        """One tensor-parallel member's share, whose block keeps ``nbytes`` times the bytes
        and takes ``ms`` times the time: the layers' inputs stay whole (the residual stream
        is not split without sequence parallelism), the rest shrinks with the block.

        ``sequence_parallel``: every byte and the cheap ops ``"selective"`` runs again
        split (``nbytes``; its kept outputs include the reduce-scatters', as torchtitan's
        op-level SAC saves them); a layer's forward run again takes its collectives again
        (``ms`` of the block's, which holds them)."""
        got = self.scaled(nbytes)
        if sequence_parallel:
            return dataclasses.replace(got, layer_fwd=self.layer_fwd * ms)
        return dataclasses.replace(got, layer_kept=self.layer_kept,
                                   layer_fwd=self.layer_fwd * ms,
                                   selective_fwd=self.selective_fwd * ms)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _KEYS}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> BlockRecompute:
        """Parse ``{"layer_kept": bytes, ..., "selective_fwd": ms}``; ValueError naming
        ``where``."""
        values = read_numbers(data, where, _KEYS, _BYTES)
        return cls(**values)


def stage_policies(facts: Sequence[BlockRecompute], blocks: Sequence[int]
                   ) -> tuple[PolicyCost, ...]:
    """A stage's :class:`PolicyCost` entries from its blocks' facts (none without facts).

    ``"layer"`` keeps what each block keeps and rebuilds the largest layer at once;
    ``"selective"`` keeps each block's matmul outputs and rebuilds the rest together.
    """
    if not facts or not blocks:
        return ()
    mine = [facts[b] for b in blocks]
    return (PolicyCost("layer", sum(f.layer_kept for f in mine),
                       max(f.layer_rebuilt for f in mine), sum(f.layer_fwd for f in mine)),
            PolicyCost("selective", sum(f.selective_kept for f in mine),
                       sum(f.selective_rebuilt for f in mine),
                       sum(f.selective_fwd for f in mine)))


class ChainPolicies:
    """:func:`stage_policies` of any range of blocks ``[a, b)``, from prefix sums (the chain
    planner asks for many)."""

    def __init__(self, facts: Sequence[BlockRecompute]) -> None:
        self.sums: np.ndarray | None = None
        if facts:
            cols = np.array([(f.layer_kept, f.layer_fwd, f.selective_kept, f.selective_rebuilt,
                              f.selective_fwd) for f in facts], dtype=np.float64)
            self.sums = np.concatenate([np.zeros((1, 5)), np.cumsum(cols, axis=0)])
            self.largest = np.array([f.layer_rebuilt for f in facts], dtype=np.int64)

    def __call__(self, a: int, b: int) -> tuple[PolicyCost, ...]:
        if self.sums is None or b <= a:
            return ()
        lk, lf, sk, sr, sf = self.sums[b] - self.sums[a]
        return (PolicyCost("layer", int(lk), int(self.largest[a:b].max()), float(lf)),
                PolicyCost("selective", int(sk), int(sr), float(sf)))


def policy_effects(policies: Sequence[bool | str], fwd: np.ndarray, activations: np.ndarray,
                   inputs: np.ndarray, known: Sequence[Sequence[PolicyCost]]
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per stage under ``policies``: ``(again, kept, rebuilt)``: the ms of forward its
    backward runs again, the bytes one forward keeps, the bytes the backward rebuilds at
    once (0 without recompute).

    ``inputs``: the bytes of each stage's incoming edges; ``known[s]``: stage ``s``'s
    :class:`PolicyCost` entries. A policy a stage has no entry for is priced as ``True``.
    """
    again = np.zeros(len(policies))
    kept = np.asarray(activations, dtype=np.float64).copy()
    rebuilt = np.zeros(len(policies))
    for s, policy in enumerate(policies):
        if not policy:
            continue
        entry = entry_of(known[s], policy)
        again[s] = rerun(fwd[s], known[s], policy)
        if entry is None:  # the stage whole (or a policy without facts)
            kept[s], rebuilt[s] = inputs[s], activations[s]
            continue
        extra = inputs[s] if policy == "selective" else 0.0
        kept[s] = min(activations[s], entry.kept + extra)
        rebuilt[s] = min(activations[s], entry.rebuilt)
    return again, kept, rebuilt


def entry_of(known: Sequence[PolicyCost], policy: bool | str) -> PolicyCost | None:
    """The entry of ``policy`` among a stage's ``known`` ones (None: priced as ``True``)."""
    if not isinstance(policy, str):
        return None
    return next((c for c in known if c.policy == policy), None)


def rerun(fwd: float, known: Sequence[PolicyCost], policy: bool | str) -> float:
    """The ms of forward a stage's backward runs again under ``policy`` (``fwd``: its
    forward's ms; ``known``: its entries)."""
    if not policy:
        return 0.0
    entry = entry_of(known, policy)
    return fwd if entry is None else min(entry.again, fwd)
