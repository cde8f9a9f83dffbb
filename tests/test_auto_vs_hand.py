"""``benchmarks/auto_vs_hand.py`` runs end to end; torch's hand split and orgel start from one loss.

The benchmark's sanity line, for one tiny workload on 2 ranks: every torch
schedule's first-step loss equals orgel's (same weights, same micro-batches).
Timings are never asserted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


@pytest.mark.slow
def test_hand_split_and_orgel_start_from_the_same_loss(cache: Path) -> None:
    import auto_vs_hand

    args = argparse.Namespace(tiny=True, warmup=1, screen=1, rounds=1, steps=1,
                              schedules=["gpipe", "1f1b", "interleaved"])
    row = auto_vs_hand.bench_row("gpt", 2, args)
    assert set(row["first_torch"]) == {"gpipe", "1f1b", "interleaved"}
    for loss in row["first_torch"].values():
        assert loss == pytest.approx(row["first_orgel"], rel=1e-5)
    assert row["torch"] > 0 and row["orgel"] > 0
