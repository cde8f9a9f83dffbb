"""Graph planner vs the best sequential plan on GraphPipe's models (App. A.2).

Costs come from FLOPs at a stated device rate, not from running the models:

* device: 50 TFLOP/s effective (a V100 with mixed precision), 16 GiB per rank,
  link 0.01 ms + 0.04 ms/MiB (~25 GB/s), 0.02 ms fixed cost per action;
  activations in fp16 (2 bytes), parameters fp32 with Adam (optimizer factor 4);
  backward = 2 x forward FLOPs, weight-grad half = forward FLOPs.
* MMT: 4 branches, each an input projection (h x h) and 8 transformer layers
  (seq 256, hidden 1024, FFN 4096, 16 heads), joined by a fusion head
  (4h -> h). Per layer and sample: 24 s h^2 + 4 s^2 h FLOPs forward, saved bytes
  34 s h + 5 a s^2 (Megatron's estimate), output 2 s h bytes.
* DLRM: 7 dense branches of 4 layers x 4096 and 7 sparse branches (an
  embedding table of 100k x 64 then 4 layers x 64), joined by a top MLP
  (concat -> 4096 -> 1).
* CANDLE-Uno: 7 branches of 4 layers x 4096, joined by 4 top layers x 4096.
* Sequential: the MMT configuration as one chain of 32 layers (GraphPipe A.3).

Mini-batch sizes per rank count are GraphPipe's; micro-batches m = 2 x ranks.
"Sequential" is the sequential planner (all schedule families, beam search) on
the linearised blocks run as a sequential pipeline: stage i feeds only stage
i+1 and forwards every live value (what GraphPipe compares against). "linear
split, DAG edges" is the same planner when values go straight to the stage
that reads them (orgel's runtime does this), so branches overlap there too.
GraphPipe's search times (M1 Max): MMT 0.12/0.76/3.00/10.11 s, DLRM
0.33/2.73/13.28/54.6 s, Uno 0.19/1.43/6.14/22.37 s at 4/8/16/32 ranks.
Run: ``python benchmarks/graphpipe_configs.py [--ranks 4 8]``.
"""

from __future__ import annotations

import argparse
import time

from orgel.plan import plan
from orgel.plan.scorer import Scorer
from orgel.plan.sequential import sequential_plan
from orgel.profile.costs import BlockCosts
from orgel.schedule.costs import Link

RATE = 50e12 / 1e3  # FLOPs per ms
MiB = 1 << 20
LINK = Link(0.01, 0.04)
OVERHEAD = 0.02
GRAPHPIPE_SECONDS = {"MMT": (0.12, 0.76, 3.00, 10.11), "DLRM": (0.33, 2.73, 13.28, 54.6),
                     "CANDLE-Uno": (0.19, 1.43, 6.14, 22.37), "Sequential": (None,) * 4}
BATCH = {"MMT": (64, 128, 256, 512), "DLRM": (256, 512, 1024, 2048),
         "CANDLE-Uno": (4096, 8192, 16384, 32768), "Sequential": (64, 128, 256, 512)}
RANKS = (4, 8, 16, 32)


class Builder:
    """Collects blocks (per-sample FLOPs and bytes) and edges, then scales to a micro-batch."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, int, int, int]] = []  # flops, params, saved, output
        self.edges: list[tuple[int, int]] = []

    def block(self, flops: float, params: int, saved: int, output: int,
              after: list[int]) -> int:
        index = len(self.rows)
        self.rows.append((flops, params, saved, output))
        self.edges += [(a, index) for a in after]
        return index

    def costs(self, samples: int) -> BlockCosts:
        fwd = [f * samples / RATE for f, _, _, _ in self.rows]
        return BlockCosts(
            fwd=fwd, bwd=[2 * t for t in fwd], wgrad=list(fwd),
            params=[p for _, p, _, _ in self.rows],
            activations=[s * samples for _, _, s, _ in self.rows],
            output=[o * samples for _, _, _, o in self.rows],
            temporary=[o * samples for _, _, _, o in self.rows], edges=self.edges,
            link=LINK, memory_per_rank=16 << 30, optimizer_factor=4,
            action_overhead=OVERHEAD)


def transformer(b: Builder, after: int | None, layers: int, s: int = 256, h: int = 1024,
                heads: int = 16) -> int:
    last = after
    for _ in range(layers):
        last = b.block(24 * s * h * h + 4 * s * s * h, (12 * h * h + 13 * h) * 4,
                       34 * s * h + 5 * heads * s * s, 2 * s * h,
                       [] if last is None else [last])
    assert last is not None
    return last


def mlp(b: Builder, after: list[int], sizes: list[int]) -> int:
    last = after
    for d_in, d_out in zip(sizes, sizes[1:], strict=False):
        last = [b.block(2 * d_in * d_out, (d_in * d_out + d_out) * 4, 2 * (d_in + d_out),
                        2 * d_out, last)]
    return last[0]


def mmt(sequential: bool = False) -> Builder:
    b = Builder()
    s, h = 256, 1024
    if sequential:
        first = b.block(2 * s * h * h, h * h * 4, 2 * s * h, 2 * s * h, [])
        last = transformer(b, first, 32)
        b.block(2 * s * 4 * h * h, 4 * h * h * 4, 2 * s * h, 2 * h, [last])
        return b
    ends = []
    for _ in range(4):
        first = b.block(2 * s * h * h, h * h * 4, 2 * s * h, 2 * s * h, [])
        ends.append(transformer(b, first, 8))
    b.block(2 * s * 4 * h * h, 4 * h * h * 4, 2 * s * 4 * h, 2 * h, ends)
    return b


def dlrm() -> Builder:
    b = Builder()
    ends = [mlp(b, [], [4096] * 5) for _ in range(7)]
    for _ in range(7):
        table = b.block(64, 100_000 * 64 * 4, 2 * 64, 2 * 64, [])
        ends.append(mlp(b, [table], [64] * 5))
    top = b.block(2 * (7 * 4096 + 7 * 64) * 4096, (7 * 4096 + 7 * 64) * 4096 * 4,
                  2 * (7 * 4096 + 7 * 64), 2 * 4096, ends)
    b.block(2 * 4096, 4096 * 4, 2 * 4096, 2, [top])
    return b


def candle() -> Builder:
    b = Builder()
    ends = [mlp(b, [], [4096] * 5) for _ in range(7)]
    join = b.block(2 * 7 * 4096 * 4096, 7 * 4096 * 4096 * 4, 2 * 7 * 4096, 2 * 4096, ends)
    mlp(b, [join], [4096] * 4)
    return b


MODELS = {"MMT": mmt, "DLRM": dlrm, "CANDLE-Uno": candle, "Sequential": lambda: mmt(True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=list(RANKS))
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--seq-time", type=float, default=8.0,
                        help="seconds for each sequential search (default 8)")
    args = parser.parse_args()
    header = (f"{'model':<11} {'ranks':>5} {'batch':>6} {'mb':>4} {'GraphPipe s':>11} "
              f"{'graph s':>8} {'ratio':>6} {'graph ms':>9} {'seq ms':>9} {'gain':>6} "
              f"{'DAG-edges ms':>12} {'gain':>6}  graph stages")
    print(header)
    print("-" * len(header))
    for name in args.models:
        builder = MODELS[name]()
        for ranks in args.ranks:
            k = RANKS.index(ranks)
            batch, m = BATCH[name][k], 2 * ranks
            costs = builder.costs(batch // m)
            t0 = time.perf_counter()
            graph = plan(costs, ranks, m, planner="graph")
            graph_s = time.perf_counter() - t0
            seq = sequential_plan(Scorer(costs, sequential=True), ranks, m, max_loops=4,
                                  time_limit=args.seq_time, per_member=16)
            linear = sequential_plan(Scorer(costs), ranks, m, max_loops=4,
                                     time_limit=args.seq_time, per_member=16)
            gp = GRAPHPIPE_SECONDS[name][k]
            ratio = f"{gp / graph_s:5.0f}x" if gp else f"{'-':>6}"
            seq_ms = seq.score.step_time if seq else float("nan")
            lin_ms = linear.score.step_time if linear else float("nan")
            stages = [len(r) for r in graph.plan.placement]
            print(f"{name:<11} {ranks:5d} {batch:6d} {m:4d} {gp if gp else '-':>11} "
                  f"{graph_s:8.3f} {ratio:>6} {graph.step_time:9.2f} {seq_ms:9.2f} "
                  f"{seq_ms / graph.step_time:5.2f}x {lin_ms:12.2f} "
                  f"{lin_ms / graph.step_time:5.2f}x  {len(stages)} stages, replicas {stages}")
    print("\ngain = sequential step / graph step (= graph throughput over sequential); "
          "ratio = GraphPipe search s / ours.")


if __name__ == "__main__":
    main()
