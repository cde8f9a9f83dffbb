"""``orgel run``: the acceptance command passes its check; bad input fails before any process."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from orgel.cli import main
from orgel.schedule.families import build_schedule
from test_timeline import gantt_kinds

pytestmark = pytest.mark.slow  # spawns gloo ranks

GPT = "examples/gpt.py:workload"


def test_run_1f1b_check_trace_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace, png = tmp_path / "step.json", tmp_path / "step.png"
    code = main(["run", GPT, "--ranks", "2", "--schedule", "1f1b", "--microbatches", "4",
                 "--steps", "3", "--check", "--trace", str(trace), "--png", str(png)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "step 3: loss" in out and "-> OK" in out
    assert "bubble" in out and "comm wait" in out
    names = {e.get("args", {}).get("name") for e in json.loads(trace.read_text())["traceEvents"]
             if e.get("name") == "process_name"}
    assert {"rank 0", "rank 1", "predicted rank 0", "predicted rank 1"} <= names
    drawn = gantt_kinds(png)  # measured and predicted: forward and backward boxes
    assert drawn["F"] > 200 and drawn["B"] > 200


def test_invalid_plan_is_rejected_before_any_process(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    plan = build_schedule("1f1b", 2, 4)
    plan = dataclasses.replace(plan, schedule=[plan.schedule[0], plan.schedule[1][:-1]])
    # (rank 1's last backward dropped)
    path = tmp_path / "plan.json"
    plan.save(path)
    code = main(["run", GPT, "--ranks", "2", "--plan", str(path)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("orgel run: ") and "rank 1" in err


def test_bad_options_say_what_to_change(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", GPT, "--ranks", "3", "--dp", "2"]) == 2
    assert "--dp 2 must divide --ranks 3" in capsys.readouterr().err
    assert main(["run", "nowhere.py:workload"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_orgels_own_errors_print_as_one_message(capsys: pytest.CaptureFixture[str]) -> None:
    """A graph break in `orgel run` was a traceback; it is one line that names what to change."""
    import orgel.models.graphbreak as graphbreak

    code = main(["run", f"{graphbreak.__file__}:build_graphbreak", "--ranks", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("orgel run: graph break") and "Traceback" not in err
    assert "h.mean().item() > 0.0" in err


@pytest.mark.slow
def test_run_bf16_mixed_checks_against_one_process_under_autocast(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", GPT, "--ranks", "2", "--microbatches", "2", "--steps", "2",
                 "--precision", "bf16-mixed", "--check", "--tolerance", "1e-5"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "-> OK" in out
    with pytest.raises(SystemExit) as info:  # argparse: not one of the choices
        main(["run", GPT, "--precision", "bf16-true"])
    assert info.value.code == 2
    assert "invalid choice: 'bf16-true'" in capsys.readouterr().err
    # float16 with loss scaling and clipping, against torch.amp.GradScaler in one process
    code = main(["run", GPT, "--ranks", "2", "--microbatches", "2", "--steps", "2",
                 "--precision", "16-mixed", "--max-grad-norm", "0.5", "--check",
                 "--tolerance", "1e-5"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "-> OK" in out


def test_run_under_torchrun_checks_against_one_process(tmp_path: Path) -> None:
    """`torchrun -m orgel run ...`: every process runs the command; process 0 decides the
    plan and reports, each prepares by it and starts as its rank (the one flow)."""
    from torchrun_job import torchrun

    script = tmp_path / "orgel_cli.py"  # the `orgel` command, as a script torchrun can run
    script.write_text("import sys\nfrom orgel.cli import main\nsys.exit(main())\n")
    log = tmp_path / "torchrun.log"
    code = torchrun(script, "run", GPT, "--ranks", "2", "--microbatches", "4", "--steps", "2",
                    "--optimizer", "adamw", "--lr", "1e-3", "--check", processes=2, log=log,
                    timeout_s=240)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert text.count("-> OK") == 1 and "step 2: loss" in text, text[-3000:]


HF_WORKLOAD = '''
import sys
sys.path.insert(0, {tests!r})
from test_loss_weights import _qwen2, prompt_only_rows


def workload():  # the model's own loss (loss_fn None), as orgel.pipeline takes it
    return _qwen2(), prompt_only_rows(0), None, None
'''


@pytest.mark.hf
def test_run_weighs_a_padded_batch_as_one_process_on_the_whole_batch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``orgel run`` finds the loss rule as ``orgel.pipeline`` does: a Hugging Face model's
    own loss (no ``loss_fn``) on a padded batch whose second micro-batch holds prompts
    without an answer trains as one process on the whole batch (it ran NaN, and
    ``loss_fn=None`` was refused)."""
    import torch

    from test_loss_weights import _qwen2, prompt_only_rows

    path = tmp_path / "hf.py"
    path.write_text(HF_WORKLOAD.format(tests=str(Path(__file__).parent)))
    code = main(["run", f"{path}:workload", "--ranks", "2", "--microbatches", "2",
                 "--steps", "2", "--lr", "0.5", "--check"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "-> OK" in out
    model, batch = _qwen2(), prompt_only_rows(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(2):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert f"step {step + 1}: loss {float(loss.detach()):.6f}" in out, out
    # --loss-rule rows weighs the micro-batches alike (mean of means): the pipeline and its
    # check both, here NaN (the empty micro-batch's 0/0), which the check reports
    code = main(["run", f"{path}:workload", "--ranks", "2", "--microbatches", "2",
                 "--steps", "1", "--loss-rule", "rows", "--check"])
    captured = capsys.readouterr()
    assert code == 1 and "step 1: loss nan" in captured.out, captured.out
    assert "the loss is nan from step 1 on (one process's too" in captured.err, captured.err


WEIGHTED_WORKLOAD = '''
import sys
sys.path.insert(0, {tests!r})
from torch import nn
from test_weighted_loss import WEIGHT, classifier, imbalanced


def workload():  # a class-weighted loss: its ranks take the weights by the rule's name
    x, y = imbalanced(0)
    return classifier(), (x,), y, nn.CrossEntropyLoss(weight=WEIGHT)
'''


def test_run_trains_a_class_weighted_loss_as_one_process_on_the_whole_batch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``orgel run`` weighs the micro-batches of a class-weighted ``nn.CrossEntropyLoss`` by
    their labels' weights (``orgel.lossweights.ClassWeights``), the ranks and the check."""
    import torch
    from torch import nn

    from test_weighted_loss import WEIGHT, classifier, imbalanced

    path = tmp_path / "weighted.py"
    path.write_text(WEIGHTED_WORKLOAD.format(tests=str(Path(__file__).parent)))
    code = main(["run", f"{path}:workload", "--ranks", "2", "--microbatches", "2",
                 "--steps", "2", "--lr", "0.5", "--check"])
    out = capsys.readouterr().out
    assert code == 0 and "-> OK" in out, out
    model, (x, y) = classifier(), imbalanced(0)
    opt, loss_fn = torch.optim.SGD(model.parameters(), lr=0.5), nn.CrossEntropyLoss(weight=WEIGHT)
    expected = []
    for _ in range(2):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(loss.detach()))
    printed = [float(v) for v in re.findall(r"step \d+: loss ([0-9.]+)", out)]
    assert printed == pytest.approx(expected, rel=1e-5), out
