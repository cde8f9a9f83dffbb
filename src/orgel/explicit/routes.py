"""Where a several-graph forward's messages go (:class:`Routes`, a base of
:class:`orgel.explicit.glued.GluedPipeline`): micro-batch ``m``'s graph calls to its
replica's ranks, keyed by the step call, the graph call and the ranks' micro-batch."""

from __future__ import annotations

import threading
from typing import Any

import torch

from orgel.batching import side_by_side
from orgel.explicit.lazy import LazyOutputs
from orgel.explicit.mailbox import Mailbox, RankPipes
from orgel.explicit.slots import Slot


class Routes:
    """The controller's messages of a graph call, both ways (a base of the glued pipeline,
    which sets what it reads)."""

    calls: int
    dp: int
    glue: Any
    replicated: tuple[str, ...]
    batch_dim: int
    _pipes: RankPipes
    _mail: Mailbox
    _lazy: LazyOutputs  # the outputs that stay on the loss rank until read
    _ranks_of: dict[int, tuple[int, ...]]  # graph call -> by replica
    _loss_ranks: list[int]
    _input_ranks: list[int]
    _fed: dict[int, dict[int, dict[str, torch.Tensor]]]
    _feed_lock: threading.Lock

    def _send(self, rank: int, message: tuple[str, Any, Any]) -> None:
        self._pipes.send(rank, message)

    def key(self, c: int, m: int) -> tuple[int, int, int]:
        """The key of graph call ``c``'s exchange of micro-batch ``m`` (the ranks' micro-batch)."""
        return (self.calls, c, m // self.dp)

    def exchange_rank(self, c: int, m: int) -> int:
        """The rank holding exchange ``c`` for micro-batch ``m`` (its replica's)."""
        return self._ranks_of[c][m % self.dp]

    def loss_rank(self, m: int) -> int:
        """The rank of the loss stage for micro-batch ``m`` (its replica's)."""
        return self._loss_ranks[m % self.dp]

    def feed(self, m: int, inputs: dict[str, torch.Tensor]) -> None:
        """Micro-batch ``m``'s model inputs: once its group's ``dp`` micro-batches all gave
        theirs, the ranks' micro-batch (theirs side by side) goes to every input rank."""
        j = m // self.dp
        with self._feed_lock:
            group = self._fed.setdefault(j, {})
            group[m] = inputs
            if len(group) < self.dp:
                return
            del self._fed[j]
        whole = side_by_side([group[k] for k in sorted(group)], self.replicated,
                             self.batch_dim)
        for r in self._input_ranks:
            self._send(r, ("in", j, whole))

    def _run(self, slot: Slot, c: int, inputs: dict[str, Any],
             values: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        m = slot.index
        if self.glue.has_exchange(c):
            self._send(self.exchange_rank(c, m),
                       ("x_in", self.key(c, m), [v.detach() for v in values]))
        if c == 0:
            self.feed(m, inputs)
        slot.sent = c + 1
        if c + 1 < len(self.glue.calls):
            return list(self._mail.get("x_out", self.key(c + 1, m), self.exchange_rank(c + 1, m),
                                       f"graph {c}'s outputs of micro-batch {m}"))
        outs = self._mail.get("out", m // self.dp, self.loss_rank(m),
                              f"the outputs of micro-batch {m}")
        # (the last one is the exchanges' anchor)
        return self._lazy.wrap(list(outs[:-1]), self.loss_rank(m))

    def _back(self, slot: Slot, c: int, grads: list[Any], count: int,
              answer: bool = True) -> list[Any]:
        """Send graph call ``c``'s output gradients to its ranks; the gradients of its
        arguments back. ``answer=False``: none of them takes one (the model's inputs, say),
        so nothing waits for the ranks' answer (it comes, and the next step drops it)."""
        m = slot.index
        if c + 1 < len(self.glue.calls):
            self._send(self.exchange_rank(c + 1, m),
                       ("x_outgrad", self.key(c + 1, m), grads))
        else:
            self._send(self.loss_rank(m), ("grad", m // self.dp, [*grads, None]))
        if not self.glue.has_exchange(c) or not answer:
            return [None] * count
        return list(self._mail.get("x_ingrad", self.key(c, m), self.exchange_rank(c, m),
                                   f"the gradients of graph {c}'s arguments of micro-batch {m}"))

    def _back_unreached(self, slot: Slot, *, after: int) -> None:
        """Run the backward of every call after ``after`` that has not, with zero gradients.

        The autograd engine reaches a call's backward before its predecessor's
        (the anchors chain them) unless the loss does not depend on the call at
        all; then its true gradients are zero, and its argument gradients, which
        would flow into nothing, are dropped.
        """
        for c in range(min(slot.calls, len(self.glue.calls)) - 1, after, -1):
            if c not in slot.backed:
                slot.backed.add(c)
                self._back(slot, c, [None] * self.glue.calls[c].outputs,
                           len(self.glue.calls[c].glue), answer=False)
