"""Graph planner vs sequential pipelines on GraphPipe's models, sweeping the micro-batch size.

GraphPipe (§7.4-7.5, App. A.2) gains from two things: concurrent branches make
the pipeline shallower (shorter warm-up and cool-down), and shallower pipelines
hold fewer activations in their early stages, so a larger micro-batch fits and
runs more efficiently. Both planners here get the same candidates: every power
of two that divides the mini-batch (GraphPipe's sweep), as ``m = batch / mb``
micro-batches of ``mb`` samples, one ``plan(...)`` call each; the fastest
feasible candidate of each planner is compared.

Device model (a V100-SXM2 16 GB, fp16 mixed precision), a roofline per GEMM::

    time = max(FLOPs / PEAK, bytes moved / HBM) + LAUNCH

* ``PEAK`` = 50 TFLOP/s: the V100's tensor cores peak at 125 TFLOP/s; large
  cuBLAS fp16 GEMMs reach ~90, and a training step with its element-wise ops
  ~40-60, so 50 is the compute-bound rate;
* ``HBM`` = 720 GB/s: 80 % of the 900 GB/s HBM2 peak (what STREAM-like copies get);
* bytes moved by ``(r x k) @ (k x n)`` in fp16: ``2 (r k + k n + r n)``; a
  layer's weight is read once per micro-batch, so a 4096 x 4096 layer is
  memory-bound below ~70 rows (the ridge point 50e12 / 720e9 = 69 FLOP/byte):
  with 8 rows it runs at 8/70 of the compute rate. Attention's per-sample
  matmuls (QK^T, AV) are batched over samples and heads; their time is linear
  in the micro-batch. Element-wise ops are not modelled;
* ``LAUNCH`` = 0.005 ms per GEMM (a CUDA kernel launch and its tail, ~5 us on a
  V100), so tiny micro-batches also pay fixed costs;
* backward = an input-gradient and a weight-gradient GEMM per forward GEMM,
  each moving the same three matrices: bwd = 2 x fwd, wgrad = fwd;
* 16 GiB per rank; parameters counted in fp32 bytes with optimizer factor 4
  (fp16 weights + fp16 grads + fp32 master, Adam m and v = 16 B/param);
  activations fp16 (MMT per layer and sample: 34 s h + 5 a s^2 bytes,
  Megatron's estimate); link 0.01 ms + 0.04 ms/MiB (~25 GB/s); 0.02 ms fixed
  cost per action (kernel launches).

Models (App. A.2): MMT (4 branches of an input projection and 8 transformer
layers, seq 256, hidden 1024, FFN 4096, 16 heads, joined by a 4h -> h fusion),
DLRM (7 dense branches of 4 x 4096 layers, 7 sparse branches of a 100k x 64
embedding and 4 x 64 layers, a top MLP), CANDLE-Uno (7 branches of 4 x 4096,
4 top layers), and "Sequential": MMT's 32 layers as one chain (App. A.3).

Planners: ``graph`` is ``plan(..., planner="graph", rows=mb, dp=None)``: stage
DAG, per-stage replicas, DAG 1F1B's zero-bubble rewrite, and (``dp=None``) the
graph pipeline replicated over ``d`` data-parallel groups, as seq is. ``seq``
is the sequential planner with every schedule family (1F1B, ZB-H1,
interleaved, looped, ...) on the linearised blocks run as a classic
sequential pipeline (stage i feeds only stage i+1 and forwards every live
value), and that pipeline replicated ``d`` times for every ``d`` dividing the
ranks and the micro-batch (gradients all-reduced; d = ranks is plain data
parallelism). ``1f1b`` is the same with 1F1B only, what
GraphPipe's baselines PipeDream and Piper run (PipeDream replicates stages
individually; here only the whole pipeline is). All step times come from the
one simulator (without the end-of-step loss all-reduce, which all plans pay
alike).

Columns: ``mb x m`` the chosen micro-batch size x count; ``spl/ms`` samples
per ms; ``gain`` graph throughput over seq, over 1f1b, and over seq's best
pipeline without data parallelism (``g/pipe``, d = 1); ``seq fit`` the
largest micro-batch the sequential pipeline fits without recomputation (``*``
when seq's choice is that limit, i.e. memory-limited); ``bubble`` the seq
plan's idle fraction; ``search`` the time of all the sweep's graph plan()
calls, ``/call`` per call, ``graph`` one ``graph_plan`` call on all ranks alone,
per call (plan() also tries each ``dp``, scores three uniform 1F1B baselines
and predicts the result); GraphPipe's search times (M1 Max) are
MMT 0.12/0.76/3.00/10.11 s, DLRM 0.33/2.73/13.28/54.6 s, Uno
0.19/1.43/6.14/22.37 s at 4/8/16/32 ranks.

Run: ``python benchmarks/graphpipe_configs.py`` (4 and 8 ranks, about 1 min on
two busy cores); ``--ranks 16 32`` for the large configurations (about 3 min);
``--memory 4`` to see memory bind.

What it shows: under
this model memory never binds at GraphPipe's mini-batches (every micro-batch
fits a 16 GiB V100), MMT is compute-bound from one sample (256 rows), and the
largest single blocks (DLRM's top layer, Uno's join, ~20 % of the FLOPs)
bound the stage time for every planner. So the graph plan's gains come from
fewer, larger micro-batches on the memory-bound MLP models (DLRM 1.16x at 4
ranks) and from shallow pipelines where the sequential one has no data
parallelism to hide its bubbles (Uno 1.96x / 3.64x at 16 / 32 ranks over a
pure pipeline); against sequential pipelines that may also replicate, the
gain is 0.98-1.16x. The ``bound`` column caps what any plan doing seq's
computation (its micro-batch size) can gain, by removing all of seq's idle
time: 1.07-1.13x on MMT, so 1.3x there would need a larger micro-batch to run
faster per sample, which MMT's compute-bound GEMMs do not. DLRM and Uno leave
more idle time (bounds 1.3-5x), but it waits on the join block (one GEMM with
~20 % of the FLOPs) and on its weight all-reduce once replicated, which bind
the graph plan as well.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from orgel.costs.blocks import BlockCosts
from orgel.plan import plan
from orgel.plan.graph import graph_plan
from orgel.plan.planner import InfeasibleError
from orgel.plan.scorer import Scorer
from orgel.plan.sequential import sequential_plan
from orgel.plan.transforms import replicate
from orgel.schedule.costs import Link
from orgel.sim import simulate

PEAK = 50e12 / 1e3  # FLOPs per ms, compute-bound rate
HBM = 720e9 / 1e3  # bytes per ms
LAUNCH = 0.005  # ms per GEMM kernel
MEMORY = 16 << 30
LINK = Link(0.01, 0.04)
OVERHEAD = 0.02
GRAPHPIPE_SECONDS = {"MMT": (0.12, 0.76, 3.00, 10.11), "DLRM": (0.33, 2.73, 13.28, 54.6),
                     "CANDLE-Uno": (0.19, 1.43, 6.14, 22.37), "Sequential": (None,) * 4}
BATCH = {"MMT": (64, 128, 256, 512), "DLRM": (256, 512, 1024, 2048),
         "CANDLE-Uno": (4096, 8192, 16384, 32768), "Sequential": (64, 128, 256, 512)}
RANKS = (4, 8, 16, 32)

# A GEMM of one block: (rows per sample, k, n, shared). ``shared``: the (k x n)
# operand is a weight read once per micro-batch; otherwise every sample brings
# its own (attention scores), ``count`` times.
Gemm = tuple[int, int, int, bool, int]


def gemm_ms(g: Gemm, samples: int) -> float:
    """Roofline time of one GEMM for a micro-batch of ``samples``."""
    rows, k, n, shared, count = g
    if shared:
        r = rows * samples
        flops, moved = 2.0 * r * k * n * count, 2.0 * (r * k + k * n + r * n) * count
    else:
        flops = 2.0 * rows * k * n * count * samples
        moved = 2.0 * (rows * k + k * n + rows * n) * count * samples
    return max(flops / PEAK, moved / HBM) + LAUNCH  # batched: one kernel for all heads


class Builder:
    """Collects blocks (GEMMs, bytes per sample) and edges; costs for a micro-batch size."""

    def __init__(self) -> None:
        self.memory = MEMORY
        self.rows: list[tuple[list[Gemm], int, int, int]] = []  # gemms, params, saved, output
        self.edges: list[tuple[int, int]] = []

    def block(self, gemms: list[Gemm], params: int, saved: int, output: int,
              after: list[int]) -> int:
        index = len(self.rows)
        self.rows.append((gemms, params, saved, output))
        self.edges += [(a, index) for a in after]
        return index

    def costs(self, samples: int) -> BlockCosts:
        fwd = [sum(gemm_ms(g, samples) for g in gemms) for gemms, _, _, _ in self.rows]
        return BlockCosts(
            fwd=fwd, bwd=[2 * t for t in fwd], wgrad=list(fwd),
            params=[p for _, p, _, _ in self.rows],
            activations=[s * samples for _, _, s, _ in self.rows],
            output=[o * samples for _, _, _, o in self.rows],
            temporary=[o * samples for _, _, _, o in self.rows], edges=self.edges,
            link=LINK, memory_per_rank=self.memory, optimizer_factor=4,
            action_overhead=OVERHEAD)


def transformer(b: Builder, after: int | None, layers: int, s: int = 256, h: int = 1024,
                heads: int = 16) -> int:
    d = h // heads
    gemms: list[Gemm] = [(s, h, 3 * h, True, 1), (s, h, h, True, 1), (s, h, 4 * h, True, 1),
                         (s, 4 * h, h, True, 1), (s, d, s, False, heads),
                         (s, s, d, False, heads)]
    last = after
    for _ in range(layers):
        last = b.block(gemms, (12 * h * h + 13 * h) * 4, 34 * s * h + 5 * heads * s * s,
                       2 * s * h, [] if last is None else [last])
    assert last is not None
    return last


def mlp(b: Builder, after: list[int], sizes: list[int]) -> int:
    last = after
    for d_in, d_out in zip(sizes, sizes[1:], strict=False):
        last = [b.block([(1, d_in, d_out, True, 1)], (d_in * d_out + d_out) * 4,
                        2 * (d_in + d_out), 2 * d_out, last)]
    return last[0]


def mmt(sequential: bool = False) -> Builder:
    b = Builder()
    s, h = 256, 1024
    proj: list[Gemm] = [(s, h, h, True, 1)]
    if sequential:
        first = b.block(proj, h * h * 4, 2 * s * h, 2 * s * h, [])
        last = transformer(b, first, 32)
        b.block([(s, 4 * h, h, True, 1)], 4 * h * h * 4, 2 * s * h, 2 * h, [last])
        return b
    ends = []
    for _ in range(4):
        first = b.block(proj, h * h * 4, 2 * s * h, 2 * s * h, [])
        ends.append(transformer(b, first, 8))
    b.block([(s, 4 * h, h, True, 1)], 4 * h * h * 4, 2 * s * 4 * h, 2 * h, ends)
    return b


def dlrm() -> Builder:
    b = Builder()
    ends = [mlp(b, [], [4096] * 5) for _ in range(7)]
    for _ in range(7):
        # A gather of one 64-wide row per sample: no weight traffic beyond the rows read.
        table = b.block([(1, 1, 64, False, 1)], 100_000 * 64 * 4, 2 * 64, 2 * 64, [])
        ends.append(mlp(b, [table], [64] * 5))
    width = 7 * 4096 + 7 * 64
    top = b.block([(1, width, 4096, True, 1)], (width * 4096 + 4096) * 4, 2 * width,
                  2 * 4096, ends)
    b.block([(1, 4096, 1, True, 1)], 4097 * 4, 2 * 4096, 2, [top])
    return b


def candle() -> Builder:
    b = Builder()
    ends = [mlp(b, [], [4096] * 5) for _ in range(7)]
    join = b.block([(1, 7 * 4096, 4096, True, 1)], (7 * 4096 * 4096 + 4096) * 4,
                   2 * 7 * 4096, 2 * 4096, ends)
    mlp(b, [join], [4096] * 4)
    return b


MODELS = {"MMT": mmt, "DLRM": dlrm, "CANDLE-Uno": candle, "Sequential": lambda: mmt(True)}


@dataclass
class Pick:
    """The best candidate of one planner over the micro-batch sweep."""

    mb: int
    m: int
    step: float
    label: str
    bubble: float = 0.0


def sweep_sizes(batch: int, ranks: int, max_per_rank: int) -> list[int]:
    """Micro-batch sizes: powers of two dividing ``batch`` with at most
    ``max_per_rank x ranks`` micro-batches (more only add per-action costs)."""
    out, mb = [], 1
    while mb <= batch:
        if batch % mb == 0 and batch // mb <= max_per_rank * ranks:
            out.append(mb)
        mb *= 2
    return out


def seq_pick(costs: BlockCosts, ranks: int, m: int, mb: int, families: list[str] | None,
             seconds: float) -> tuple[Pick | None, Pick | None, bool]:
    """The best sequential pipeline, replicated ``d`` times for every ``d`` dividing the
    ranks and the micro-batch (PipeDream's data-parallel stages, uniformly); and whether
    any fits without recomputation."""
    best: Pick | None = None
    alone: Pick | None = None  # the pipeline without data parallelism (d = 1)
    fits = False
    full = Scorer(costs, sequential=True)
    for d in (d for d in range(1, ranks + 1) if ranks % d == 0 and mb % d == 0):
        sub = full if d == 1 else Scorer(costs.scaled(1.0 / d), sequential=True)
        res = sequential_plan(sub, ranks // d, m, max_loops=4 if families is None else 1,
                              families=families, time_limit=seconds, per_member=16)
        if res is None:
            continue
        p = full.to_plan(res.template, _chain(res.points, costs.num_blocks), res.recompute)
        sim = simulate(replicate(p, d) if d > 1 else p)
        if not sim.fits:
            continue
        fits = fits or res.recompute is None or not any(res.recompute)
        label = res.template.label + (f" x dp{d}" if d > 1 else "")
        pick = Pick(mb, m, sim.step_time, label, sim.bubble_fraction)
        if best is None or pick.step < best.step:
            best = pick
        if d == 1:
            alone = pick
    return best, alone, fits


def _chain(points: tuple[int, ...], n: int) -> list[range]:
    bounds = [0, *points, n]
    return [range(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def run_config(name: str, builder: Builder, ranks: int, batch: int, args: argparse.Namespace
               ) -> str:
    graph: Pick | None = None
    seq: Pick | None = None
    pipe: Pick | None = None
    one: Pick | None = None
    seq_fit = 0
    search = 0.0
    calls = 0
    alone = 0.0
    for mb in sweep_sizes(batch, ranks, args.max_per_rank):
        m = batch // mb
        costs = builder.costs(mb)
        t0 = time.perf_counter()
        try:
            g = plan(costs, ranks, m, planner="graph", rows=mb, dp=None)
        except InfeasibleError:
            g = None
        search += time.perf_counter() - t0
        calls += 1
        # The graph planner alone (plan() also scores uniform baselines and predicts).
        t0 = time.perf_counter()
        graph_plan(Scorer(costs), ranks, m, pure_dp=False, rows=mb)
        alone += time.perf_counter() - t0
        if g is not None:
            step = g.step_time - g.plan.prediction.get("end_of_step", 0.0)
            if graph is None or batch / step > batch / graph.step:
                label = f"{g.planner}: {g.plan.meta.get('schedule_label', '')}"
                graph = Pick(mb, m, step, f"{label}; replicas "
                             f"{[len(r) for r in g.plan.placement]}", g.sim.bubble_fraction)
        s, s1, fits = seq_pick(costs, ranks, m, mb, None, args.seq_time)
        if s1 is not None and (pipe is None or s1.step < pipe.step):
            pipe = s1
        if fits:
            seq_fit = max(seq_fit, mb)
        if s is not None and (seq is None or s.step < seq.step):
            seq = s
        o, _, _ = seq_pick(costs, ranks, m, mb, ["1f1b"], args.seq_time)
        if o is not None and (one is None or o.step < one.step):
            one = o
    k = RANKS.index(ranks)
    gp = GRAPHPIPE_SECONDS[name][k]

    def cell(p: Pick | None) -> str:
        if p is None:
            return f"{'-':>22}"
        return f"{p.mb:>4}x{p.m:<3} {p.step:8.2f} {batch / p.step:6.2f}"

    gain_s = f"{seq.step / graph.step:5.2f}x" if seq and graph else "    -"
    gain_o = f"{one.step / graph.step:5.2f}x" if one and graph else "    -"
    gain_p = f"{pipe.step / graph.step:5.2f}x" if pipe and graph else "    -"
    top = max(sweep_sizes(batch, ranks, args.max_per_rank))
    limited = "*" if seq is not None and seq.mb == seq_fit < top else " "
    return (f"{name:<10} {ranks:3d} {batch:6d} | {cell(graph)} | {cell(seq)} | {cell(one)} | "
            f"{gain_s} {gain_o} {gain_p} | {seq_fit:5d}{limited} "
            f"{seq.bubble if seq else float('nan'):5.2f} "
            f"{1 / (1 - seq.bubble) if seq else float('nan'):5.2f}x | {search:6.3f} "
            f"{search / max(calls, 1):6.3f} {alone / max(calls, 1):6.3f} {gp if gp else '-':>6}\n"
            f"{'':21}{graph.label if graph else '-'}   seq: "
            f"{seq.label if seq else '-'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=[4, 8],
                        help="rank counts among 4 8 16 32 (default 4 8)")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--seq-time", type=float, default=2.0,
                        help="seconds for each sequential beam search (default 2)")
    parser.add_argument("--memory", type=float, default=MEMORY / (1 << 30),
                        help="GiB per rank (default 16, a V100)")
    parser.add_argument("--max-per-rank", type=int, default=4,
                        help="largest micro-batch count swept, per rank (default 4)")
    args = parser.parse_args()
    for r in args.ranks:
        if r not in RANKS:
            parser.error(f"--ranks takes values among {RANKS}, got {r}")
    print(f"device: roofline per GEMM, peak {PEAK * 1e3 / 1e12:.0f} TFLOP/s, HBM "
          f"{HBM * 1e3 / 1e9:.0f} GB/s (ridge {PEAK / HBM:.0f} FLOP/B), "
          f"{LAUNCH} ms/GEMM launch, "
          f"{args.memory:g} GiB/rank, link {LINK.latency} ms + {LINK.per_mib} ms/MiB, "
          f"{OVERHEAD} ms/action, fp16 activations, 16 B/param (Adam)")
    header = (f"{'model':<10} {'rk':>3} {'batch':>6} | {'graph mb x m':>12} {'ms':>4} "
              f"{'spl/ms':>6} | {'seq mb x m':>12} {'ms':>4} {'spl/ms':>6} | "
              f"{'1f1b mb x m':>12} {'ms':>4} {'spl/ms':>6} | "
              f"{'gain':>5} {'g/1f1b':>6} {'g/pipe':>6} | "
              f"{'seqfit':>6} {'bubbl':>5} {'bound':>6} | "
              f"{'search':>6} {'/call':>6} {'graph':>6} {'GP s':>6}")
    print(header)
    print("-" * len(header))
    for name in args.models:
        builder = MODELS[name]()
        builder.memory = int(args.memory * (1 << 30))
        for ranks in args.ranks:
            print(run_config(name, builder, ranks, BATCH[name][RANKS.index(ranks)], args),
                  flush=True)
    print("\ngain = graph samples/ms over seq (all families) | over 1f1b-only | over seq "
          "without data parallelism (d = 1); "
          "seqfit = largest mb the sequential pipeline fits without recompute "
          "(* = seq chose it: memory-limited); bubbl = seq plan's idle fraction (waiting "
          "on messages and all-reduces included); bound = 1 / (1 - bubbl): no plan doing "
          "seq's computation at seq's micro-batch size gains more.")


if __name__ == "__main__":
    main()
