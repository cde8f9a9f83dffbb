"""Every architecture of the coverage zoo trains one step through orgel exactly as in one process.

Each model goes through ``orgel.pipeline`` on 2 ranks with 2 micro-batches and
SGD (the production path: capture, split, spawn, step), with a FLOP-balanced
1F1B chain as its plan so that the suite needs no profiling; the model must
come back from ``orgel.pipeline`` bit-identical, and every parameter and buffer
after the step must match gradient accumulation in one process
(``archzoo.check``). ``benchmarks/coverage.py`` runs the same zoo with
orgel's own planning.

The Hugging Face models carry the ``hf`` marker: ``.ci/run`` runs them again
under transformers 4.x (``tests/transformers4.sh``).
"""

from __future__ import annotations

import re

import pytest
import transformers

from archzoo import archs
from archzoo.check import balanced_check

ARCHS = archs()
#: Models orgel refuses, with the error it must give: the break's line and why the forward
#: cannot run as several graphs either (a parameter trained by code outside every graph).
OUTSIDE = r".*trained by code Dynamo ran outside every graph"
REFUSED = {
    # reversible layers: a custom autograd Function whose backward runs the layers again
    "hf_reformer": r"graph break .*modeling_reformer\.py:\d+ " + OUTSIDE,
}
if transformers.__version__.startswith("4."):
    REFUSED.update({
        # 4.x draws `torch.rand([])` for layerdrop and branches on it; the frames around the
        # break run the embedding (a torch.nn module Dynamo does not trace alone) eagerly
        "hf_opt": r"graph break .*modeling_opt\.py:\d+ `if dropout_probability" + OUTSIDE,
        "hf_bart": r"graph break .*modeling_bart\.py:\d+ `if dropout_probability" + OUTSIDE,
        "hf_whisper": r"graph break .*modeling_whisper\.py:\d+ `if dropout_probability" + OUTSIDE,
        # 4.x loops over the experts that some token chose (`for expert_idx in expert_hit`)
        "hf_mixtral": r"graph break .*modeling_mixtral\.py:\d+ `for expert_idx" + OUTSIDE,
    })


def _params(names: list[str]) -> list[object]:
    return [pytest.param(n, marks=[pytest.mark.slow] + ([pytest.mark.hf] if n.startswith("hf_")
                                                        else []))
            for n in names]


@pytest.mark.parametrize("name", _params([n for n in ARCHS if n not in REFUSED]))
def test_one_step_matches_one_process(name: str) -> None:
    outcome = balanced_check(name, ARCHS[name])
    assert outcome.status == "exact", outcome.line() + "\n" + outcome.trace


@pytest.mark.parametrize("name", _params(sorted(REFUSED)))
def test_refused_with_the_line_to_change(name: str) -> None:
    outcome = balanced_check(name, ARCHS[name])
    assert outcome.status == "fails"
    assert re.search(REFUSED[name], outcome.detail), outcome.detail
