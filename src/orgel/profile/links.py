"""Link benchmark: ping-pong between two ranks over the real backend, fitted to latency + bytes.

Two local processes join a process group (gloo on CPU, NCCL when asked on
GPUs), rank 0 sends a tensor of each size and rank 1 sends it back; half the
median round trip is one transfer. A least-squares line through (MiB, ms)
gives ``Link(latency, per_mib)``. On one machine every rank pair shares the
same path, so one pair stands for all; across nodes measure per pair.
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from orgel.schedule.costs import Link

DEFAULT_SIZES = (1 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)


def fit_link(samples: list[tuple[int, float]]) -> Link:
    """Least-squares ``ms = latency + per_mib * MiB`` through ``(bytes, ms)`` samples.

    Both coefficients are clamped at 0 (noise can tilt a line through tiny times).
    """
    if len(samples) < 2:
        raise ValueError("need at least two (bytes, ms) samples to fit a link")
    xs = [b / (1 << 20) for b, _ in samples]
    ys = [t for _, t in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    slope = max(slope, 0.0)
    return Link(latency=max(my - slope * mx, 0.0), per_mib=slope)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, backend: str, sizes: tuple[int, ...], repeats: int,
            out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=2)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    results: list[tuple[int, float]] = []
    try:
        for nbytes in sizes:
            buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
            times = []
            for i in range(repeats + 2):  # two warm-ups
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= 2:
                    times.append((time.perf_counter() - t0) * 1000.0 / 2)
            results.append((nbytes, statistics.median(times)))
        if rank == 0:
            with open(out_path, "w") as f:
                f.write("\n".join(f"{b} {t}" for b, t in results))
    finally:
        dist.destroy_process_group()


def measure_link(*, backend: str = "gloo", sizes: tuple[int, ...] = DEFAULT_SIZES,
                 repeats: int = 5) -> tuple[Link, list[tuple[int, float]]]:
    """Ping-pong between two local ranks; returns the fitted link and the samples."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < 2:
        raise ValueError("the nccl link benchmark needs two GPUs; use backend='gloo'")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "link.txt")
        args: tuple[Any, ...] = (_free_port(), backend, tuple(sizes), repeats, out)
        mp.start_processes(_worker, args=args, nprocs=2, join=True, start_method="spawn")
        with open(out) as f:
            samples = [(int(b), float(t)) for b, t in (line.split() for line in f)]
    return fit_link(samples), samples
