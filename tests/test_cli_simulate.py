"""``orgel simulate`` and ``orgel show`` through the CLI's main(argv), in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orgel.cli import main
from orgel.schedule import Plan, StageGraph
from orgel.schedule.text import parse_schedule
from test_timeline import gantt_kinds


def simulate_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["simulate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


BASE = ("--ranks", "4", "--microbatches", "8", "--fwd", "1", "--bwd", "2")


def test_closed_form_step_times(capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate_json(capsys, "--schedule", "1f1b", *BASE)["step_time"] == 33
    assert simulate_json(capsys, "--schedule", "gpipe", *BASE)["step_time"] == 33
    out = simulate_json(capsys, "--schedule", "interleaved", "--stages-per-rank", "2", *BASE)
    assert (out["step_time"], out["num_stages"]) == (28.5, 8)
    assert simulate_json(capsys, "--schedule", "zb-h1", *BASE, "--wgrad", "1")["step_time"] == 27


def test_per_rank_inflight_and_memory(capsys: pytest.CaptureFixture[str]) -> None:
    gpipe = simulate_json(capsys, "--schedule", "gpipe", *BASE, "--activations", "1000",
                          "--edge-bytes", "0")
    one_f_one_b = simulate_json(capsys, "--schedule", "1f1b", *BASE, "--activations", "1000",
                                "--edge-bytes", "0")
    assert [r["peak_inflight"] for r in gpipe["per_rank"]] == [8, 8, 8, 8]
    assert [r["peak_inflight"] for r in one_f_one_b["per_rank"]] == [4, 3, 2, 1]
    assert gpipe["per_rank"][0]["peak_memory"] == 8000
    assert one_f_one_b["per_rank"][0]["peak_memory"] == 4000
    assert gpipe["bubble_fraction"] == pytest.approx(3 / 11)
    assert set(gpipe["per_rank"][0]) >= {"busy", "peak_memory", "peak_inflight"}


def test_comm_latency_and_looped_options(capsys: pytest.CaptureFixture[str]) -> None:
    out = simulate_json(capsys, "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2",
                        "--comm-latency", "0.5")
    assert out["step_time"] == 10  # 9 plus two message hops (tests/test_sim.py)
    # Pfeife's (B, N_l, B_l, B_f) = (8, 2, 4, (3, 2, 1, 0)) is interleaved 1F1B
    looped = simulate_json(capsys, "--schedule", "looped", *BASE, "--loops", "2",
                           "--loop-batch", "4", "--prefetch", "3,2,1,0")
    assert looped["step_time"] == 28.5


def test_table_and_timeline_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "1f1b", *BASE]) == 0
    out = capsys.readouterr().out
    assert "step time 33 ms" in out
    assert "critical path: F0.0 F1.0 F2.0 F3.0 B3.0" in out
    assert "rank3 |.........F0 B0" in out


def test_outputs_and_plan_file_round_trip(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    png, trace, plan_file = tmp_path / "t.png", tmp_path / "t.json", tmp_path / "plan.json"
    assert main(["simulate", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "3",
                 "--fwd", "2", "--bwd", "4", "--png", str(png), "--trace", str(trace),
                 "--out", str(plan_file)]) == 0
    capsys.readouterr()
    drawn = gantt_kinds(png)  # the chart holds the schedule's forward and backward boxes
    assert drawn["F"] > 200 and drawn["B"] > 200 and drawn["I"] < 10
    assert json.loads(trace.read_text())["traceEvents"]
    saved = Plan.load(plan_file)
    assert saved.prediction is not None and saved.prediction["step_time"] == 24
    # the saved plan carries its costs: simulating it again gives the same time
    assert simulate_json(capsys, str(plan_file))["step_time"] == 24
    # a memory cap in the plan's costs is reported
    data = json.loads(plan_file.read_text())
    data["costs"]["memory_per_rank"] = 1
    data["costs"]["stages"][1]["params"] = 8
    plan_file.write_text(json.dumps(data))
    assert main(["simulate", str(plan_file)]) == 0
    assert "memory per rank 1 B: exceeded on ranks [1]" in capsys.readouterr().out
    # uniform options override the plan's costs
    assert simulate_json(capsys, str(plan_file), "--fwd", "1", "--bwd", "2")["step_time"] == 12
    assert main(["show", str(plan_file)]) == 0
    shown = capsys.readouterr().out
    assert "rank0: F0.0 F0.1 B0.0 F0.2 B0.1 B0.2" in shown
    assert "simulated step (plan costs): 24 ms" in shown


def test_show_hand_written_plan_without_costs(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    plan = Plan(StageGraph.chain(2), [(0,), (1,)], 2, 1,
                parse_schedule("rank0: F0.0 B0.0\nrank1: F1.0 B1.0"))
    path = tmp_path / "hand.json"
    plan.save(path)
    assert main(["show", str(path), "--width", "12"]) == 0
    out = capsys.readouterr().out
    assert "forward 1 ms, backward 2 ms per stage): 6 ms" in out
    assert "rank0 |F0......B0  \nrank1 |..F0B0  ....\n       0       6 ms" in out


@pytest.mark.parametrize("argv,message", [
    ([], "give either a PLAN.json or --schedule"),
    (["--schedule", "1f1b"], "--schedule needs --ranks"),
    (["--schedule", "1f1b", "--ranks", "0"], "--ranks must be at least 1"),
    (["--schedule", "1f1b", "--ranks", "2", "--loops", "2"], "--loops applies to"),
    (["--schedule", "looped", "--ranks", "2", "--prefetch", "a,b"], "comma-separated"),
    (["--schedule", "zb-h1", "--ranks", "2", "--bwd", "1", "--wgrad", "2"], "make it <= bwd"),
    (["--schedule", "interleaved", "--ranks", "4", "--microbatches", "6"], "multiple of"),
    (["missing.json"], "cannot read missing.json"),
])
def test_user_errors_are_one_line(argv: list[str], message: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_show_reports_a_bad_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    assert main(["show", str(path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    plan = Plan(StageGraph.chain(2), [(0,), (1,)], 2, 1,
                parse_schedule("rank0: F0.0 B0.0\nrank1: B1.0 F1.0"))
    plan.save(path)
    assert main(["simulate", str(path)]) == 2
    assert "rank 1" in capsys.readouterr().err
    assert main(["show", str(path)]) == 2
    captured = capsys.readouterr()
    assert "rank1: B1.0 F1.0" in captured.out and "cannot simulate" in captured.err
