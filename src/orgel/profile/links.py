"""Link benchmark: ping-pong every ordered rank pair over the real backend, fit latency + bytes.

:func:`measure_links` starts ``world`` local processes once (gloo on CPU, NCCL
on GPUs) and measures the ordered pairs ``(a, b)`` one after another while the
other ranks idle at a barrier. Rank ``a`` sends ``n`` bytes and rank ``b``
answers with 4 bytes, so a round trip costs both latencies plus ``n`` bytes
``a -> b``: a line through the fastest round trips ``(MiB, ms)``, weighted by
relative error so the small sizes set the intercept and the large ones the
slope, gives the pair's ms/MiB (its slope) and latency (half its intercept).
Every wait is bounded by ``timeout`` and a timeout names the pair it was
measuring.

:func:`summarize_links` reduces the pairs to a default link (the median) plus
the pairs that differ from it materially: on one host every pair shares one
path, so a plan keeps a single link.
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from orgel.launch.errors import transport_reason
from orgel.schedule.costs import Link

DEFAULT_SIZES = (1 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
WARMUP = 2  # untimed ping-pongs per size (connection set-up, allocator)

Pair = tuple[int, int]
Samples = list[tuple[int, float]]


def fit_link(samples: Samples, *, relative: bool = False) -> Link:
    """Least-squares ``ms = latency + per_mib * MiB`` through ``(bytes, ms)`` samples.

    ``relative``: minimise relative rather than absolute errors (weights
    ``1/ms^2``), so microsecond latencies are not drowned by the noise of
    millisecond transfers. Both coefficients are clamped at 0 (noise can tilt a
    line through tiny times).
    """
    if len(samples) < 2:
        raise ValueError("need at least two (bytes, ms) samples to fit a link")
    xs = [b / (1 << 20) for b, _ in samples]
    ys = [t for _, t in samples]
    ws = [1.0 / max(y, 1e-9) ** 2 if relative else 1.0 for y in ys]
    total = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / total
    my = sum(w * y for w, y in zip(ws, ys, strict=True)) / total
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True))
    slope = max(sxy / sxx if sxx else 0.0, 0.0)
    return Link(latency=max(my - slope * mx, 0.0), per_mib=slope)


def ordered_pairs(world: int) -> list[Pair]:
    """Every ordered pair ``(a, b)``, ``a != b``, in the order they are measured."""
    return [(a, b) for a in range(world) for b in range(world) if a != b]


def measure_links(world: int = 2, *, backend: str = "gloo",
                  sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 5,
                  timeout: float = 60.0) -> dict[Pair, Link]:
    """Latency and bandwidth of every ordered pair of ``world`` local ranks, fitted per pair.

    ``sizes`` (bytes, at least two distinct) are sent ``repeats`` timed times
    each (the fastest is kept: other processes only ever add time).
    ``timeout`` (seconds) bounds every wait; a rank that stalls raises
    :class:`orgel.launch.errors.WorkerError` naming the pair.
    """
    samples = measure_link_samples(world, backend=backend, sizes=sizes, repeats=repeats,
                                   timeout=timeout)
    return {pair: link_from_round_trips(s) for pair, s in samples.items()}


def link_from_round_trips(samples: Samples) -> Link:
    """The one-way link behind ``(bytes there, round-trip ms)`` samples with a tiny reply.

    The bytes travel one way (the slope is that direction's ms/MiB); the
    intercept holds a latency each way, so one message pays half of it. A
    smaller message is never slower on the same link, so a size slower than a
    larger one (a scheduling hiccup in every repeat) takes the larger's time.
    """
    ordered = sorted(samples)
    for k in range(len(ordered) - 2, -1, -1):
        ordered[k] = (ordered[k][0], min(ordered[k][1], ordered[k + 1][1]))
    line = fit_link(ordered, relative=True)
    return Link(latency=line.latency / 2, per_mib=line.per_mib)


def measure_link_samples(world: int = 2, *, backend: str = "gloo",
                         sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 5,
                         timeout: float = 60.0) -> dict[Pair, Samples]:
    """The ``(bytes, round-trip ms)`` samples behind :func:`measure_links`, per ordered pair.

    A round trip carries the bytes from ``a`` to ``b`` and 4 bytes back.
    """
    from orgel.launch.spawn import spawn

    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(f"world must be an integer >= 2 (ranks to measure between), got {world!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ValueError(f"the nccl link benchmark needs {world} GPUs, found "
                         f"{torch.cuda.device_count()}; use backend='gloo' or a smaller world")
    if len(set(sizes)) < 2 or min(sizes) < 4:
        raise ValueError(f"sizes must hold at least two distinct byte counts >= 4, got {sizes}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")
    # gloo ranks are forked (no imports to repeat); NCCL ones spawned: a child forked from a
    # process that used CUDA cannot use it
    per_rank = spawn(_ping_pong, world, backend, tuple(sizes), repeats, timeout,
                     timeout=timeout, backend=backend,
                     context="fork" if backend == "gloo" else "spawn")
    merged: dict[Pair, Samples] = {}
    for got in per_rank:
        merged.update(got)
    return {pair: merged[pair] for pair in ordered_pairs(world)}


def summarize_links(links: dict[Pair, Link], *, tolerance: float = 0.2,
                    nbytes: int = 1 << 20) -> tuple[Link, dict[Pair, Link]]:
    """The median link, plus the pairs that differ from it materially.

    A pair differs when its time for an ``nbytes`` message is more than
    ``tolerance`` (relative) away from the median link's: one number that
    weighs latency and bandwidth as a typical activation would, and is less
    noisy than either coefficient alone. An empty dict means one link
    describes every pair (plans stay simple).
    """
    if not links:
        raise ValueError("no links to summarize: measure at least one pair")
    if tolerance < 0 or nbytes <= 0:
        raise ValueError(f"tolerance must be >= 0 and nbytes > 0, got {tolerance}, {nbytes}")
    median = Link(latency=statistics.median(lk.latency for lk in links.values()),
                  per_mib=statistics.median(lk.per_mib for lk in links.values()))
    ref = median.time(nbytes)
    odd = {pair: lk for pair, lk in links.items()
           if abs(lk.time(nbytes) - ref) > tolerance * ref}
    return median, dict(sorted(odd.items()))


# -- one rank of the benchmark (runs under orgel.launch.spawn.spawn) -----------------


def _ping_pong(rank: int, world: int, backend: str, sizes: tuple[int, ...], repeats: int,
               timeout: float) -> dict[Pair, Samples]:
    """Measure every ordered pair in turn; return the samples of the pairs this rank led."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    bench = _Bench(rank, device, timeout)
    out: dict[Pair, Samples] = {}
    for a, b in ordered_pairs(world):
        bench.barrier(f"before pair {a}->{b}")
        if rank not in (a, b):
            continue
        samples = [(nbytes, bench.round_trips((a, b), nbytes, repeats)) for nbytes in sizes]
        if rank == a:
            out[(a, b)] = samples
    bench.barrier("after the last pair")
    return out


class _Bench:
    """Timed point-to-point exchanges of one rank, every wait bounded by ``timeout``."""

    def __init__(self, rank: int, device: torch.device, timeout: float) -> None:
        self.rank, self.device = rank, device
        self.timeout = timedelta(seconds=timeout)
        self.reply = torch.zeros(1, device=device)

    def _wait(self, work: Any, where: str) -> None:
        try:
            if self.device.type == "cuda":
                work.wait()  # the group's own timeout bounds NCCL; sync to time it
                torch.cuda.synchronize(self.device)
            else:
                work.wait(timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - re-raised with the pair named
            raise RuntimeError(f"link benchmark: {where} failed after at most "
                               f"{self.timeout.total_seconds():g} s: {transport_reason(exc)}"
                               ) from exc

    def barrier(self, where: str) -> None:
        """Every rank meets here (an all-reduce, which takes a timeout on gloo)."""
        flag = torch.zeros(1, device=self.device)
        self._wait(dist.all_reduce(flag, async_op=True), f"the barrier {where}")

    def round_trips(self, pair: Pair, nbytes: int, repeats: int) -> float:
        """Fastest of ``repeats`` round trips (ms): ``nbytes`` from ``pair[0]``, 4 bytes back."""
        a, b = pair
        leads = self.rank == a
        peer = b if leads else a
        buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=self.device)
        times = []
        for i in range(repeats + WARMUP):
            t0 = time.perf_counter()
            if leads:
                self._wait(dist.isend(buf, peer), f"sending {nbytes} bytes of pair {a}->{b}")
                self._wait(dist.irecv(self.reply, peer), f"the reply of pair {a}->{b}")
            else:
                self._wait(dist.irecv(buf, peer), f"receiving {nbytes} bytes of pair {a}->{b}")
                self._wait(dist.isend(self.reply, peer), f"replying to pair {a}->{b}")
            if i >= WARMUP:
                times.append((time.perf_counter() - t0) * 1000.0)
        return min(times)
