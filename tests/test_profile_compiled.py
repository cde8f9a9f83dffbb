"""With ``compile=True`` the profiler times each block as its compiled stage runs
(:mod:`orgel.profile.compiled`), so the planner plans what the ranks run.

Inductor compiles slowly on a small CPU: the models are tiny and the blocks few.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import orgel
import orgel.profile.compiled as profile_compiled
import orgel.runtime.compiled as runtime_compiled
from orgel.graph.capture import capture
from orgel.models.gpt import GPT, GPTConfig, lm_loss
from orgel.profile.workload import profile_graph
from orgel.workload import Workload

#: Inductor starts the C++ compiler
pytestmark = pytest.mark.slow


def _counted(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    """Count the calls of ``owner.name`` (in this process)."""
    calls: list[int] = []
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_the_blocks_are_timed_as_compiled_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block's forward, backward and both backward halves run through its compiled
    stage while the table is timed; the table says so and how long compiling took."""
    stages = _counted(monkeypatch, runtime_compiled.CompiledStage, "__call__")
    halves = _counted(monkeypatch, runtime_compiled, "compiled_input_backward")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, seq_len=16))
    tokens = torch.randint(0, 64, (8, 16))
    workload = Workload(model, (tokens,), tokens, lm_loss)
    graph = capture(model, {"tokens": tokens[:4]})
    costs = profile_graph(workload, graph, microbatches=2, blocks=3, link=False,
                          use_cache=False, progress=False, warmup=1, repeats=2, compiled=True)
    assert costs.meta["compiled"] and costs.meta["compile_s"] > 0
    blocks = len(costs.fwd)
    # each block: its jobs' first runs, the timed rounds, and every block in sequence
    assert len(stages) >= blocks * 3
    assert len(halves) >= blocks  # the runtime's I (and the W it leaves) per block
    assert all(t > 0 for t in costs.fwd)
    eager = profile_graph(workload, graph, microbatches=2, blocks=3, link=False,
                          use_cache=False, progress=False, warmup=1, repeats=2)
    assert not eager.meta["compiled"]
    assert costs.names == eager.names  # the same blocks, timed two ways
    with pytest.raises(ValueError, match="meta model"):
        profile_graph(workload, graph, microbatches=2, blocks=3, link=False, use_cache=False,
                      progress=False, compiled=True, source=object())


def test_orgel_pipeline_with_compile_plans_from_compiled_blocks(
        monkeypatch: pytest.MonkeyPatch, cache: Any) -> None:
    """``orgel.pipeline(compile=True)`` with the planner (an empty profile cache): the
    calling process profiles the compiled blocks, and the compiled ranks then train as one
    eager process."""
    from test_checkpointing import Stack

    jobs = _counted(monkeypatch, profile_compiled, "compiled_jobs")
    torch.manual_seed(0)
    model = Stack(layers=2, width=16)
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randn(8, 2)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    with orgel.pipeline(model, (x,), y, torch.nn.functional.mse_loss, ranks=2,
                        microbatches=2, compile=True, timeout_s=600, optimizer=sgd) as pipe:
        assert jobs and pipe.plan.meta["block_graph"]["compiled"]  # planned from them
        got = pipe.step((x,), y)
        assert sum(pipe.compile_s) > 0  # the ranks' stages compiled too
        state = pipe.state_dict()
    opt = sgd(reference.parameters())
    want = 0.0
    for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True):
        loss = torch.nn.functional.mse_loss(reference(xm), ym) / 2
        loss.backward()
        want += loss.item()
    opt.step()
    assert float(got) == pytest.approx(want, rel=1e-5)
    for name, t in reference.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-4, atol=1e-5, msg=name)


def test_a_compiled_calls_cost_is_taken_off_each_block_once() -> None:
    """A stage of many blocks is one compiled call: each block timed alone paid the call's
    host cost, so the table takes it off every job of every block and off the blocks in
    sequence (keeping a tenth of each at least)."""
    from orgel.profile.compiled import less_calls

    times = [{"fwd": 1.0, "bwd": 2.0, "inp": 1.5}, {"fwd": 0.05}, {"whole": 5.0}]
    less_calls(times, 2, {"fwd": 0.1, "bwd": 0.2, "inp": 0.15})
    assert times[0] == pytest.approx({"fwd": 0.9, "bwd": 1.8, "inp": 1.35})
    assert times[1] == pytest.approx({"fwd": 0.005})  # a tenth kept
    assert times[2]["whole"] == pytest.approx(5.0 - 2 * 0.3)


def test_orgel_plan_compile_profiles_compiled_blocks(
        tmp_path: Any, cache: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``orgel plan --compile`` plans from a table of compiled blocks (the plan file says
    so); with a table made otherwise (``--costs``, ``--device``) it is refused."""
    from orgel.cli import main
    from orgel.schedule.ir import Plan
    from test_cli_plan import WORKLOAD, write_costs

    source = tmp_path / "tiny.py"
    source.write_text(WORKLOAD)
    out = tmp_path / "plan.json"
    assert main(["plan", f"{source}:tiny", "--ranks", "2", "--microbatches", "2",
                 "--blocks", "3", "--no-link", "--compile", "--out", str(out)]) == 0
    meta = Plan.load(out).meta["block_graph"]
    assert meta["compiled"] and meta["compile_s"] > 0
    costs = write_costs(tmp_path / "costs.json")
    capsys.readouterr()
    assert main(["plan", "--costs", str(costs), "--ranks", "2", "--compile"]) == 2
    assert "leave --compile out" in capsys.readouterr().err
