"""The composition matrix: every feature on every entry point, against one process.

Each cell is a training script as people write it (``tests/matrix_cell.py``: a Hugging
Face Qwen2 on right-padded batches from a data collator (``BatchEncoding``s) whose labels
are -100 on the padding, the model's own
``outputs.loss``, AdamW) run through one entry point of orgel with one feature or a pair,
and the same training in one process over the same micro-batches. A cell is exact (the
losses and every weight as one process has them, bf16-mixed too; a bf16-mixed cell with
tensor parallelism at most twice as far from a float64 run as one process in bf16 is, see
``matrix_cell.run_cell``), or refused
before anything starts with
an error that says why and what to do; :data:`REFUSED` lists the refusals, each with the
words its error must contain, and docs/limitations.md says why each is not done yet.

``local`` and ``backend`` cells run in this process (orgel forks its ranks from it); the
``torchrun`` cells of one process count run one after another in one torchrun job, so
every pipeline after the first is built in processes where one was built and closed.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

import matrix_cell
from orgel.flow.options import REFUSED as REFUSED_OPTIONS
from torchrun_job import torchrun

pytestmark = pytest.mark.slow

FEATURES = ["base", "evaluate", "accumulate", "dp", "fsdp", "tp", "bf16", "meta", "break",
            "if_end", "length", "last", "resume", "tied"]
#: (a graph break's capture is the matrix's slowest part, so a break with dp and with a new
#: length is one cell, dp+break+length, and a break with accumulate is tp+accumulate+break)
PAIRS = ["tp+bf16", "fsdp+accumulate", "tp+accumulate+break", "tp+length",
         "meta+fsdp", "evaluate+bf16+break", "sp+length", "dp+break+length", "meta+bf16",
         "compile+length"]
#: the pairs run under torchrun too (each feature does)
TORCHRUN_PAIRS = ["tp+break"]

#: (entry, cell) -> words the refusal must contain. Every other cell must be exact.
REFUSED: dict[tuple[str, str], str] = {
    # Dynamo traces the compiled model in the caller, where meta parameters meet real inputs
    ("backend", "meta"): REFUSED_OPTIONS[("backend", "weights")],
}

if version("transformers").startswith("4."):  # the CI's 4.x leg (tests/transformers4.sh)
    # 4.x's rotary embedding opens torch.autocast on the meta device, which torch refuses
    # even in eager mode; transformers 5 does not
    REFUSED.update({(entry, cell): "opens torch.autocast on the meta device"
                    for entry in ("local", "torchrun") for cell in ("meta", "meta+fsdp",
                                                                     "meta+bf16")})

#: how far a cell may be from one process (float32 sums in another order), and from float64
#: beside one process in bf16 where a cell rounds unlike one process by its nature
TOLERANCE = {"32": 2e-4, "bf16": 2e-3}


def _features(cell: str) -> list[str]:
    return [] if cell == "base" else cell.split("+")


def _processes(features: list[str]) -> int:
    return 4 if {"dp", "fsdp", "tp", "sp"} & set(features) else 2


def check(entry: str, cell: str, report: dict[str, Any]) -> None:
    """Assert ``report`` is what :data:`REFUSED` and the tolerances say it must be."""
    refused = REFUSED.get((entry, cell))
    if refused is not None:
        assert "error" in report, f"{entry} {cell} now runs: take it out of REFUSED"
        assert refused in report["message"], report["message"]
        return
    assert "error" not in report, f"{entry} {cell}: {report.get('trace', report)}"
    tol = TOLERANCE["bf16" if "diff64" in report else "32"]
    assert not report["missing"], report["missing"]
    # (step, micro-batch) the calling process ran whole: the pipeline did not train them
    assert not report.get("off_path"), f"{entry} {cell} left the captured graphs: {report}"
    assert len(report["losses"]) == len(report["ref"])
    if "compiled" in report:  # a third length runs the graphs symbolic in the second's sizes
        first, second, third = report["compiled"]
        assert third == second > first > 0, report["compiled"]
    for got, want in zip(report["losses"], report["ref"], strict=True):
        assert abs(got - want) <= (10 if "diff64" in report else 1) * tol, report
    if "diff64" in report:  # rounds unlike one process by its nature: against float64
        assert report["diff64"] <= 2 * report["ref_diff64"] + tol, report
    else:
        assert report["diff"] <= tol, report["diff"]
    if "eval" in report:
        got, want = report["eval"]
        assert abs(got - want) <= tol, report["eval"]
        if "logits64" in report:  # the weights round unlike one process's: against float64
            assert report["logits64"] <= 2 * report["ref_logits64"] + 10 * tol, report
        else:
            assert report["logits_diff"] <= 10 * tol, report["logits_diff"]


def _in_process(entry: str, cell: str, out: Path) -> dict[str, Any]:
    matrix_cell.main([{"entry": entry, "features": _features(cell)}], out)
    return dict(json.loads((out / cell / "result0.json").read_text()))


# one worker runs the local cells: the later ones reuse the first one's trace of Qwen2
# (orgel.graph.reuse), which a backend cell's torch._dynamo.reset() (matrix_cell.run_cell)
# would drop
@pytest.mark.xdist_group("matrix-local")
@pytest.mark.parametrize("cell", FEATURES + PAIRS)
def test_local(cell: str, tmp_path: Path) -> None:
    check("local", cell, _in_process("local", cell, tmp_path))


@pytest.mark.parametrize("cell", [*FEATURES, "accumulate+break", "bf16+break", "tp+break",
                                  "sp+break", "dp+break+length", "compile+length"])
def test_backend(cell: str, tmp_path: Path) -> None:
    check("backend", cell, _in_process("backend", cell, tmp_path))


def _torchrun_job(cells: list[str], nproc: int, out: Path) -> None:
    """Run ``cells`` one after another in one torchrun job of ``nproc`` processes."""
    specs = json.dumps([{"entry": "torchrun", "features": _features(c)} for c in cells])
    script = Path(matrix_cell.__file__)
    torchrun(script, specs, str(out), processes=nproc, log=out / f"torchrun{nproc}.log",
             timeout_s=240 * len(cells), pythonpath=[script.parent])


@pytest.fixture(scope="session")
def torchrun_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every torchrun cell, run once: two jobs (of 2 and of 4 processes).

    Session-scoped, so that a worker runs the jobs (about 200 s) at most once whatever
    order its tests come in; that one worker runs every cell is the ``xdist_group`` below
    (which pytest 9 had undone: the jobs ran on both workers, see ``conftest.py``)."""
    out = tmp_path_factory.mktemp("torchrun")
    for nproc in (2, 4):
        cells = [c for c in FEATURES + TORCHRUN_PAIRS if _processes(_features(c)) == nproc]
        _torchrun_job(cells, nproc, out)
    return out


# one worker runs every torchrun cell: pytest-xdist (`--dist loadgroup`) would otherwise
# start the module's two torchrun jobs once per worker that gets a cell
@pytest.mark.xdist_group("matrix-torchrun")
@pytest.mark.parametrize("cell", FEATURES + TORCHRUN_PAIRS)
def test_torchrun(cell: str, torchrun_results: Path) -> None:
    nproc = _processes(_features(cell))
    results = [torchrun_results / cell / f"result{r}.json" for r in range(nproc)]
    log = (torchrun_results / f"torchrun{nproc}.log")
    missing = [str(p) for p in results if not p.exists()]
    assert not missing, f"no result from {missing}: {log.read_text()[-3000:]}"
    reports = [json.loads(p.read_text()) for p in results]
    for report in reports:
        check("torchrun", cell, report)
