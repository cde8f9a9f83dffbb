"""``orgel graph``: summaries of the op graph, blocks and a balanced split; PNG; user errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from orgel.cli import main

ROOT = Path(__file__).resolve().parents[1]




def test_gpt_example_with_stages_and_png(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    png = tmp_path / "blocks.png"
    rc = main(["graph", f"{ROOT}/examples/gpt.py:workload", "--blocks", "8", "--stages", "3",
               "--microbatches", "4", "--png", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "op graph (dynamo, sizes for one of 4 micro-batches)" in out
    assert "inputs: tokens" in out and "blocks: 8" in out
    assert "split into 3 stages" in out
    assert "from stage 0:" in out and "to stage 2:" in out and "model outputs:" in out
    assert png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unet_shows_long_skips(capsys: pytest.CaptureFixture) -> None:
    rc = main(["graph", f"{ROOT}/examples/unet.py:workload", "--blocks", "10", "--stages", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    skips = next(line for line in out.splitlines() if "long skips:" in line)
    assert "->" in skips  # U-Net's encoder-decoder skips cross blocks
    assert "joins:" in out


def _write(tmp_path: Path, body: str) -> str:
    path = tmp_path / "wl.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_user_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["graph", f"{tmp_path}/missing.py:workload"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("orgel graph: workload file") and err.count("\n") == 1
    good = _write(tmp_path, """
        import torch
        def workload():
            return torch.nn.Linear(4, 2), (torch.randn(6, 4),), torch.randint(0, 2, (6,)), \\
                torch.nn.functional.cross_entropy
    """)
    assert main(["graph", f"{good}:workload", "--microbatches", "4"]) == 2
    assert "not divisible into 4 micro-batches" in capsys.readouterr().err
    assert main(["graph", f"{good}:workload", "--blocks", "2", "--stages", "3"]) == 2
    assert "--stages must be between 1 and --blocks" in capsys.readouterr().err


def test_a_graph_break_is_reported_as_several_graphs(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    path = _write(tmp_path, """
        from orgel.models import build
        def workload():
            return tuple(build("graphbreak"))
    """)
    assert main(["graph", f"{path}:workload"]) == 0
    out = capsys.readouterr().out
    assert "captured the forward as 2 graphs" in out and "graphbreak.py:" in out
    assert "exchange" in out  # the point where the Python between the graphs runs
