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

from archzoo import archs
from archzoo.check import backend_check, balanced_check

ARCHS = archs()
#: Models orgel refuses, with the error it must give: the break's line and why the forward
#: cannot run as several graphs either.
REFUSED = {
    # reversible layers: a custom autograd Function runs the layers (graphs with gradients
    # off) in its forward and again in its backward
    "hf_reformer": r"graph break .*modeling_reformer\.py:\d+ .*runs with gradients off",
}


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


#: Through ``torch.compile(model, backend=orgel.backend(...))`` and a closure: forwards Dynamo
#: captures as several graphs (a branch, ``.item()``, Longformer's global-attention check)
#: and as one (GPT-2, whose 4.x masks use vmap; a CNN with BatchNorm and in-place activations).
BACKEND = ["data_dependent_branch", "item_print", "siamese_batchnorm", "hf_longformer",
           "hf_gpt2", "mobilenet_v3"]


@pytest.mark.parametrize("name", _params(BACKEND))
def test_the_compile_backend_matches_one_process(name: str) -> None:
    outcome = backend_check(name, ARCHS[name])
    assert outcome.status == "exact", outcome.line() + "\n" + outcome.trace
