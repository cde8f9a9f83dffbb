"""Point-to-point messages of one rank: receives posted ahead, asynchronous sends, timeouts.

Executes :func:`orgel.schedule.comm.derive_comm` exactly: message ``i`` carries
the values of its edge (activations) or their gradients, one tensor per value,
each with its own tag (``base[i] + j``) so that gloo matches them whatever the
posting order. Receive buffers are allocated once per message and reused every
step; their shapes come from a shape exchange over the rendezvous store, done
on the first step and again only when the step's input shapes change (or every
step with ``dynamic_shapes``) — never a metadata round-trip per message.

Posting. With gloo (``post_ahead``) every receive of the step is posted at the
start, so a message that has arrived is never waited for. With NCCL, sends and
receives between a pair share one stream and match in issue order, so receives
are posted lazily, in channel order, right before they are needed.

Releasing sends. A sent tensor stays alive until its send completes; the
transport drops completed sends (work handle and tensor) as the step goes, at
every send and receive, instead of keeping them all until the step ends:

* NCCL: ``work.is_completed()`` is a non-blocking event query; completed sends
  are dropped, nothing ever blocks the host before :meth:`Transport.finish`.
* gloo: a send's ``is_completed()`` stays false until someone waits on it, and a
  send completes only once the receiver posted its receive. When every receive
  of the step was posted ahead at its start (``post_ahead`` and no shape
  exchange), a wait is safe (the receiver posts without waiting for this rank)
  and short: the sends made after action ``p`` are waited at the first send or
  receive once action ``p + 1`` has run (they had a whole action to transfer),
  so at most one action's sends are pending. ``max_pending_bytes`` caps them
  further (waiting the oldest first; one message larger than the cap is still
  sent). Steps that exchange shapes or post just in time post receives only
  when the receiver needs them, so waiting early could deadlock: their sends
  are held until the step ends.

``peak_pending_bytes`` / ``peak_pending`` record the most bytes / messages
pending at once during the current step, ``sent_bytes`` all it sent.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from orgel.launch.errors import CommFailure, transport_reason
from orgel.schedule.comm import CommPlan, describe
from orgel.schedule.ir import Plan

# Transports are created in the same order on every rank (like process groups),
# so this count names one plan's shape keys in the shared store.
_instances = 0

#: Default cap on the bytes of sends pending at once (gloo, receives posted ahead).
MAX_PENDING_BYTES = 64 << 20
#: The store key (one per plan instance) a failing rank sets to its message, so that the
#: others' waits on the store stop early.
ABORT_KEY = "orgel/abort/{instance}"
#: The store key (one per plan instance and abandoned step) a rank whose own work raised
#: sets to its report; the step goes on with placeholders and every rank drops it.
STEP_FAILED_KEY = "orgel/step-failed/{instance}/{count}"
#: The store key a tensor-parallel member whose own work raised sets to the action's
#: position (one per plan instance, dropped-step count and process): whether its partners
#: set theirs to the same position says whether they raised there too.
MEMBER_FAILED_KEY = "orgel/member-failed/{instance}/{count}/{process}"
#: How long such a member waits for its partners' keys (seconds): members that raise at
#: the same action (the same data) do so within the compute between two collectives.
MEMBERS_AGREE_S = 3.0
#: The longest pause between two looks at the store while waiting for a key (seconds): at
#: most this late after the key arrives (a look is one round trip to the store, ~0.1 ms)
POLL_S = 0.005


class PeerAborted(RuntimeError):
    """Another rank set the abort flag; the message is its failure."""


@dataclass(eq=False)  # identity: deque.remove must not compare tensors
class _Send:
    """One message in flight: its work handles keep ``tensors`` alive until done."""

    index: int
    works: list[Any]
    tensors: list[torch.Tensor]
    nbytes: int
    pos: int  # position of the sending action in this rank's list


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a shape exchange")
    return dtype


class Transport:
    """The messages one rank sends and receives for one Plan.

    ``ranks[r]`` is the global rank of plan rank ``r`` (identity by default).
    ``timeout`` (seconds) bounds every wait; a wait that times out or loses its
    peer raises :class:`CommFailure` naming the peer and the message.
    ``max_pending_bytes`` caps the bytes of pending sends where waiting early is
    safe (see the module docstring); ``None``: no cap beyond one action's sends.
    ``nccl``: the group is NCCL's (its waits only order streams). On gloo with a CUDA
    ``device`` (ranks sharing a GPU, :mod:`orgel.launch.devices`) every message is
    staged through host memory: gloo sends and receives host tensors only.
    """

    def __init__(self, plan: Plan, comm_plan: CommPlan, rank: int, *, store: Any,
                 device: torch.device, timeout: float, post_ahead: bool,
                 group: Any = None, ranks: list[int] | None = None,
                 max_pending_bytes: int | None = MAX_PENDING_BYTES, nccl: bool = False) -> None:
        if max_pending_bytes is not None and max_pending_bytes < 0:
            raise ValueError(f"max_pending_bytes must be >= 0 bytes or None, got "
                             f"{max_pending_bytes}")
        self.plan = plan
        self.comm = comm_plan
        self.rank = rank
        self.store = store
        self.device = device
        self.nccl = nccl
        #: where messages travel: gloo's are host tensors, staged to and from a GPU
        self.wire = device if nccl or device.type != "cuda" else torch.device("cpu")
        self.timeout = timeout
        self.post_ahead = post_ahead
        self.group = group
        self.ranks = list(range(plan.num_ranks)) if ranks is None else list(ranks)
        edges = plan.stage_graph.edges
        self.base: list[int] = []
        tag = 0
        for m in comm_plan.messages:
            self.base.append(tag)
            tag += max(1, len(edges[m.edge].values))
        self.incoming = [i for i, m in enumerate(comm_plan.messages) if m.dst_rank == rank]
        # position of each incoming message in its channel, for in-order lazy posting
        self.channel_pos: dict[int, tuple[tuple[int, int], int]] = {}
        for key, indices in comm_plan.channels.items():
            for p, i in enumerate(indices):
                self.channel_pos[i] = (key, p)
        self.shapes: dict[int, list[tuple[tuple[int, ...], torch.dtype]]] = {}
        self.buffers: dict[int, list[torch.Tensor]] = {}
        self.posted: dict[int, list[Any]] = {}
        self.posted_buffers: dict[int, list[torch.Tensor]] = {}
        self.next_in_channel: dict[tuple[int, int], int] = {}
        self.max_pending_bytes = max_pending_bytes
        self.pending: deque[_Send] = deque()
        self.pending_bytes = 0
        self.peak_pending_bytes = 0
        self.peak_pending = 0
        self.sent_bytes = 0
        self.settle = False  # whether waiting on a send before the step ends is safe
        global _instances
        _instances += 1
        self.instance = _instances
        self.exchange = True
        self.epoch = 0
        #: the shapes and dtypes each outgoing message last had (what a placeholder sends)
        self.sent_specs: dict[int, list[tuple[tuple[int, ...], torch.dtype]]] = {}
        self.abandoned = 0  # steps every rank dropped so far: names the next failure's key
        self.wait_ms: dict[int, float] = {}

    # -- step boundaries ----------------------------------------------------------

    def set_shapes(self, shapes: dict[int, list[tuple[tuple[int, ...], torch.dtype]]]) -> None:
        """The incoming messages' shapes, known without an exchange (every rank agrees)."""
        for i, spec in shapes.items():
            if self.shapes.get(i) != spec:
                self.shapes[i] = spec
                self.buffers.pop(i, None)

    def begin(self, *, exchange_shapes: bool) -> None:
        """Start a step; ``exchange_shapes`` publishes/reads shapes through the store.

        The first step exchanges them too. Every rank decides alike (the shape keys are
        numbered by the exchanges made): not by whether it knows shapes, which a rank
        that receives nothing (the first rank of a forward-only pass) never does.
        """
        self.exchange = exchange_shapes or self.epoch == 0
        if self.exchange:
            self.epoch += 1
        self.posted, self.posted_buffers = {}, {}
        self.next_in_channel = {key: 0 for key in self.comm.channels}
        self.pending.clear()
        self.pending_bytes = self.peak_pending_bytes = self.peak_pending = self.sent_bytes = 0
        # gloo with every receive posted now on every rank (same inputs, same decision)
        self.settle = self.post_ahead and not self.exchange and not self.nccl
        if self.post_ahead and not self.exchange:
            for i in self.incoming:
                self._post(i)

    def finish(self) -> None:
        """Wait for every send still pending (their buffers may then be reused)."""
        while self.pending:
            self._complete(self.pending[0])

    def release(self, pos: int) -> None:
        """Drop the sends that completed before action ``pos`` (called at every boundary).

        Sends are dropped once their work is done (NCCL: polled); with gloo, where
        waiting is safe, the sends of actions before ``pos - 1`` are waited (see
        the module docstring), so at most one action's sends stay pending.
        """
        if not self.pending:
            return
        if self.settle:
            while self.pending and self.pending[0].pos < pos - 1:
                self._complete(self.pending[0])
        elif self.nccl:
            for send in [s for s in self.pending if all(w.is_completed() for w in s.works)]:
                self._drop(send)

    def _complete(self, send: _Send) -> None:
        m = self.comm.messages[send.index]
        for w in send.works:
            self._wait(w, send.index, m.dst_rank, "sending")
        self._drop(send)

    def _drop(self, send: _Send) -> None:
        self.pending.remove(send)
        self.pending_bytes -= send.nbytes

    # -- receiving ----------------------------------------------------------------

    def _shape_key(self, i: int) -> str:
        return f"orgel/shape/{self.instance}/{self.epoch}/{i}"

    def _wait_key(self, key: str) -> None:
        """Wait for ``key`` in the store, looking at this plan's abort flag
        (:data:`ABORT_KEY`) too: a failed rank's flag ends the wait early.

        A store wait does not see a peer die (the store lives on rank 0, not on the peer),
        so the wait looks at both keys in turn, at most :data:`POLL_S` apart (not with
        ``store.wait`` in slices: torch logs a warning to stderr for every slice that ends
        without the key, "likely a timeout", on a wait as ordinary as a slower peer's).
        """
        deadline = time.monotonic() + self.timeout
        abort = ABORT_KEY.format(instance=self.instance)
        pause = 0.0005
        while not self.store.check([key]):
            if self.store.check([abort]):
                raise PeerAborted(self.store.get(abort).decode(errors="replace"))
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {self.timeout:g} s waiting for {key}")
            time.sleep(pause)
            pause = min(2 * pause, POLL_S)

    def announce_failure(self, message: str) -> None:
        """Set this plan's abort flag to ``message`` unless a first failure already did.

        Best effort: peers waiting on the store stop now; the store may be gone
        with its host rank.
        """
        try:
            self.store.compare_set(ABORT_KEY.format(instance=self.instance), "", message)
        except Exception:  # noqa: BLE001 - nothing more to do for a failing rank
            pass

    # -- a step every rank drops ---------------------------------------------------

    def send_placeholder(self, i: int) -> None:
        """Send message ``i`` as zeros of the shapes it last had, for a step being dropped.

        A rank whose work raised goes on with the step's messages so that every
        posted receive finds its send and every send its receive (a posted gloo
        receive cannot be cancelled): the transport is then as reusable as after
        any step. A message never sent before has no tensors; shapes are
        exchanged in that case (the step exchanges them: the first one, or one
        after a dropped step), so the receiver posts none.
        """
        self.send(i, [torch.zeros(shape, dtype=dtype, device=self.device)
                      for shape, dtype in self.sent_specs.get(i, [])])

    def members_failed_alike(self, pos: int, processes: list[int], process: int) -> bool:
        """Whether every one of ``processes`` (a pipeline rank's tensor-parallel members,
        ``process`` among them, whose own work raised at action ``pos``) raised there too.

        A partner that did not raise runs on into a collective this member never joins, so
        it cannot drop the step: it gives no word within :data:`MEMBERS_AGREE_S`.
        """
        def key(p: int) -> str:
            return MEMBER_FAILED_KEY.format(instance=self.instance, count=self.abandoned,
                                            process=p)

        self.store.set(key(process), str(pos))
        partners = [key(p) for p in processes if p != process]
        try:
            self.store.wait(partners, timedelta(seconds=min(MEMBERS_AGREE_S, self.timeout)))
        except Exception:  # noqa: BLE001 - a partner ran on (or the store is gone)
            return False
        return all(self.store.get(k).decode() == str(pos) for k in partners)

    def announce_step_failure(self, report: str) -> None:
        """Record ``report`` as this step's failure unless another rank's came first."""
        key = STEP_FAILED_KEY.format(instance=self.instance, count=self.abandoned)
        self.store.compare_set(key, "", report)

    def step_failure(self) -> str:
        """The report of the rank whose failure came first in the step being dropped; the
        next failure gets a key of its own."""
        key = STEP_FAILED_KEY.format(instance=self.instance, count=self.abandoned)
        self.abandoned += 1
        return self.store.get(key).decode(errors="replace")

    def _what(self, i: int) -> str:
        return describe(self.plan, self.comm.messages[i])

    def _post(self, i: int) -> None:
        m = self.comm.messages[i]
        if self.exchange:
            key = self._shape_key(i)
            try:
                self._wait_key(key)
                spec = json.loads(self.store.get(key))
            except PeerAborted as exc:
                what = f"the shapes of {self._what(i)} from rank {m.src_rank}"
                raise CommFailure(f"stopped: {exc} while this rank waited for {what}",
                                  peer=m.src_rank, what=what, timed_out=False) from exc
            except Exception as exc:  # noqa: BLE001 - re-raised with the peer named
                raise self._failure(i, m.src_rank, "receiving the shapes of", exc) from exc
            shapes = [(tuple(s), _dtype(d)) for s, d in spec]
            if self.shapes.get(i) != shapes:
                self.shapes[i] = shapes
                self.buffers.pop(i, None)
        if self.post_ahead:
            if i not in self.buffers:
                self.buffers[i] = [self._empty(s, d) for s, d in self.shapes[i]]
            buffers = self.buffers[i]
        else:
            # posted just in time: a fresh buffer from the caching allocator, so only
            # the messages in flight hold memory (not one buffer per message of the step)
            buffers = [self._empty(s, d) for s, d in self.shapes[i]]
        src = self.ranks[m.src_rank]
        self.posted_buffers[i] = buffers
        self.posted[i] = [
            dist.irecv(buf, src, group=self.group, tag=self.base[i] + j)
            for j, buf in enumerate(buffers)
        ]

    def recv(self, i: int) -> list[torch.Tensor]:
        """Wait for incoming message ``i`` and return its tensors (gloo: reused buffers)."""
        if i not in self.posted:
            # post in channel order up to i (NCCL matches a pair's messages in order)
            key, pos = self.channel_pos[i]
            order = self.comm.channels[key]
            for p in range(self.next_in_channel[key], pos + 1):
                if order[p] not in self.posted:
                    self._post(order[p])
            self.next_in_channel[key] = max(self.next_in_channel[key], pos + 1)
        m = self.comm.messages[i]
        self.release(m.recv_pos)
        for w in self.posted[i]:
            self._wait(w, i, m.src_rank, "waiting for")
        buffers = self.posted_buffers.pop(i)
        if self.wire != self.device:  # staged: the host buffer may be posted again
            return [b.to(self.device) for b in buffers]
        return buffers

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A receive buffer on the wire (pinned host memory where staged to a GPU)."""
        return torch.empty(shape, dtype=dtype, device=self.wire,
                           pin_memory=self.wire != self.device)

    # -- sending ------------------------------------------------------------------

    def send(self, i: int, tensors: list[torch.Tensor]) -> None:
        """Send message ``i`` asynchronously; released as it completes (see :meth:`release`)."""
        m = self.comm.messages[i]
        # the next action is send_pos + 1: what the previous action sent is due now
        self.release(m.send_pos + 1)
        tensors = [t.to(self.wire).contiguous() for t in tensors]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        cap = self.max_pending_bytes
        if self.settle and cap is not None:
            while self.pending and self.pending_bytes + nbytes > cap:
                self._complete(self.pending[0])
        self.sent_specs[i] = [(tuple(t.shape), t.dtype) for t in tensors]
        if self.exchange:
            spec = [[list(t.shape), str(t.dtype)] for t in tensors]
            self.store.set(self._shape_key(i), json.dumps(spec))
        dst = self.ranks[m.dst_rank]
        works = [dist.isend(t, dst, group=self.group, tag=self.base[i] + j)
                 for j, t in enumerate(tensors)]
        self.pending.append(_Send(i, works, tensors, nbytes, m.send_pos))
        self.pending_bytes += nbytes
        self.sent_bytes += nbytes
        self.peak_pending_bytes = max(self.peak_pending_bytes, self.pending_bytes)
        self.peak_pending = max(self.peak_pending, len(self.pending))

    # -- waiting ------------------------------------------------------------------

    def warm_up(self) -> None:
        """One tiny exchange per channel pair, pairs in one global order (NCCL's lazy
        per-pair set-up otherwise lets ranks block each other on their first messages)."""
        pairs = sorted({(min(a, b), max(a, b)) for a, b in self.comm.channels})
        for a, b in pairs:
            if self.rank not in (a, b):
                continue
            other = self.ranks[b if self.rank == a else a]
            out = torch.zeros(1, device=self.device)
            into = torch.empty(1, device=self.device)
            ops = [dist.P2POp(dist.isend, out, other, self.group),
                   dist.P2POp(dist.irecv, into, other, self.group)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

    def _wait(self, work: Any, i: int, peer: int, doing: str) -> None:
        if self.nccl:
            # NCCL: wait() only makes the compute stream wait (no host block); the
            # process group's own timeout (watchdog) bounds the transfer
            work.wait()
            return
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as exc:  # noqa: BLE001 - re-raised with the peer named
            raise self._failure(i, peer, doing, exc) from exc

    def _failure(self, i: int, peer: int, doing: str, exc: BaseException) -> CommFailure:
        text = str(exc)
        timed_out = "imed out" in text or "timeout" in text.lower()
        what = f"{doing} {self._what(i)} {'to' if doing == 'sending' else 'from'} rank {peer}"
        if timed_out:
            message = f"timed out after {self.timeout:g} s {what}"
        else:
            message = f"lost rank {peer} {what}: {transport_reason(exc)}"
        return CommFailure(message, peer=peer, what=what, timed_out=timed_out)
