"""The GPU path: capture, profile and train on CUDA, ranks sharing a GPU, vs one CUDA process.

Every test marked ``cuda`` needs a GPU and is skipped without one (``pytest -m cuda``
runs this leg on a GPU machine; nothing else in the suite needs one). The tests at
the end run everywhere: how the device is chosen, and a captured graph's device
constants retargeted to another device.

On one GPU, NCCL refuses two ranks, so two ranks share it over gloo and their
messages are staged through pinned host memory (:mod:`orgel.launch.devices`);
one rank uses NCCL.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from orgel.cli import main

GPT = "examples/gpt.py:workload"
ROOT = Path(__file__).resolve().parent.parent

gpu = pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA GPU")


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(["run", GPT, "--device", "cuda", "--steps", "3", "--check", *args])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "-> OK" in out.out
    return out.out


@gpu
@pytest.mark.cuda
@pytest.mark.slow
def test_two_ranks_share_one_gpu_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    """`orgel run --device cuda --check`: 2 gloo ranks on one GPU against one CUDA process."""
    out = _run(["--ranks", "2", "--schedule", "1f1b", "--microbatches", "4"], capsys)
    assert "device cuda (gloo)" in out


@gpu
@pytest.mark.cuda
@pytest.mark.slow
def test_compiled_stages_on_one_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """Inductor-compiled stages on CUDA: 1F1B, and ZB-H1's input and weight halves."""
    _run(["--ranks", "2", "--schedule", "1f1b", "--microbatches", "4", "--compile"], capsys)
    out = _run(["--ranks", "2", "--schedule", "zb-h1", "--microbatches", "4", "--compile"],
               capsys)
    assert "compiling the stages took" in out


@gpu
@pytest.mark.cuda
@pytest.mark.slow
def test_data_parallel_and_zero_bubble_on_one_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """gloo all-reduces CUDA gradients (dp=2), and the split backward runs on CUDA."""
    _run(["--ranks", "2", "--dp", "2", "--microbatches", "2"], capsys)
    _run(["--ranks", "2", "--schedule", "zb-h1", "--optimizer", "adamw", "--lr", "1e-3",
          "--max-grad-norm", "0.5"], capsys)


@gpu
@pytest.mark.cuda
@pytest.mark.slow
def test_bf16_mixed_on_one_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """The captured autocast region enters CUDA's autocast on the ranks, as in one process."""
    _run(["--ranks", "2", "--precision", "bf16-mixed", "--tolerance", "2e-3"], capsys)


@gpu
@pytest.mark.cuda
@pytest.mark.slow
def test_one_rank_uses_nccl(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(["--ranks", "1"], capsys)
    assert "device cuda (nccl)" in out


PIPELINE = textwrap.dedent("""
    import copy, sys, torch
    sys.path.insert(0, "examples")
    import orgel
    from gpt import workload

    w = workload()  # tokens (8 x 64) and next-word targets, on the CPU
    reference = copy.deepcopy(w.model)
    opt = lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    pipe = orgel.pipeline(w.model, w.inputs, w.targets, w.loss_fn, ranks=2, microbatches=4,
                          optimizer=opt, device="cuda", max_grad_norm=1.0)
    with pipe:
        losses = [pipe.step(w.inputs, w.targets) for _ in range(3)]
        evaluated = pipe.evaluate(w.inputs, w.targets)
        state = pipe.state_dict()
    model = reference.cuda()
    ref_opt = opt(list(model.parameters()))
    (x,), y = [t.cuda() for t in w.inputs], w.targets.cuda()
    ref = []
    for _ in range(3):
        ref_opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(4), y.chunk(4)):
            loss = w.loss_fn(model(xs), ys) / 4
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ref_opt.step()
        ref.append(total)
    model.eval()
    with torch.no_grad():
        ref_eval = w.loss_fn(model(x), y).item()
    for a, b in zip(losses, ref):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (losses, ref)
    assert abs(evaluated - ref_eval) <= 1e-5 * max(1.0, abs(ref_eval)), (evaluated, ref_eval)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state[name], value.cpu(), rtol=1e-4, atol=1e-5)
    print("OK", losses, ref)
""")


@gpu
@pytest.mark.cuda
@pytest.mark.slow
def test_pipeline_on_cuda_equals_one_cuda_process() -> None:
    """`orgel.pipeline(..., device="cuda")` from a CPU model: the controller forks its ranks
    before it touches CUDA (it may afterwards), each forked rank moves its stages to the GPU;
    losses, evaluation and weights equal one CUDA process, which the same script then runs
    on the GPU (run in a fresh interpreter: this test process may have used CUDA)."""
    done = subprocess.run([sys.executable, "-c", PIPELINE], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK" in done.stdout


@gpu
@pytest.mark.cuda
def test_profile_on_cuda_measures_blocks() -> None:
    """The profiler times blocks with CUDA events and counts their memory on the GPU."""
    from orgel.launch.devices import profiling_on
    from orgel.plan import plan_workload

    with profiling_on("cuda"):
        result = plan_workload(GPT, ranks=2, microbatches=4, blocks=4, link=False,
                               progress=False, planner="beam")
    costs = result.plan.costs
    assert all(s.fwd > 0 and s.bwd > 0 for s in costs.stages)
    assert result.plan.meta.get("block_graph", {}).get("device", "cuda") == "cuda"
    assert max(result.sim.peak_memory) > 0


@gpu
@pytest.mark.cuda
def test_a_controller_that_used_cuda_is_refused_with_advice() -> None:
    import orgel
    from orgel.models import build

    torch.zeros(1, device="cuda")  # this process has used CUDA now
    w = build("gpt", batch_size=8, vocab_size=64, d_model=32, n_layers=2, n_heads=2,
              seq_len=8)
    with pytest.raises(ValueError, match="pass device='cuda'"):
        orgel.pipeline(w.model, w.inputs, w.targets, w.loss_fn, ranks=2, device="cuda")


# -- everywhere ------------------------------------------------------------------------


def test_device_choice_errors_say_what_to_change() -> None:
    from orgel.launch.devices import backend_for, resolve_device

    with pytest.raises(ValueError, match="'cpu', 'cuda' or 'auto'"):
        resolve_device("tpu")
    assert resolve_device("cpu") == "cpu"
    assert resolve_device(None, model=torch.nn.Linear(2, 2)) == "cpu"
    assert backend_for("cpu", 4) == "gloo"
    if torch.cuda.device_count() == 0:
        with pytest.raises(ValueError, match="sees no GPU"):
            resolve_device("cuda")
    else:  # more ranks than GPUs share them over gloo
        assert backend_for("cuda", torch.cuda.device_count() + 1) == "gloo"


def test_captured_device_constants_follow_the_stage() -> None:
    """A graph captured on the CPU names the CPU (positions, the autocast region): placed on
    another device, its ops name that device."""
    from orgel.graph.capture import capture
    from orgel.graph.measure import place
    from orgel.workload import load_workload, microbatches, with_precision

    w = with_precision(load_workload(GPT), "bf16-mixed")
    graph = capture(w.model, microbatches(w, 4)[0][0], several=False, precision="bf16-mixed")
    gm = graph.graph_module
    assert "device(type='cpu')" in gm.code and "'cpu'" in gm.code
    place(gm, torch.device("meta"))
    assert "device(type='cpu')" not in gm.code and "_enter_autocast('cpu'" not in gm.code
    assert "device(type='meta')" in gm.code
    assert all(p.is_meta for p in gm.parameters())


_SEEN: list[str] = []


def _plan_here() -> object:
    from orgel.schedule.families import build_schedule

    _SEEN.append("planned")  # in the planning process only
    return build_schedule("1f1b", 2, 4)


@pytest.mark.slow
def test_the_plan_for_cuda_ranks_is_made_in_a_process_of_its_own() -> None:
    """The caller of CUDA ranks plans in a forked process (which may use the GPU): the
    plan comes back, and nothing of the planning ran in the caller."""
    from orgel.explicit.device_plan import plan_in_child

    plan = plan_in_child(_plan_here, device="cpu", timeout_s=60)
    assert (plan.num_ranks, plan.microbatches, plan.num_stages) == (2, 4, 2)
    assert _SEEN == []


def _plan_after_links() -> object:
    from orgel.profile.workload import link_costs

    link_costs(ranks=2, backend="gloo", use_cache=False)  # ranks forked from the planner
    return _plan_here()


@pytest.mark.slow
def test_the_planning_process_measures_links_between_processes_it_forks() -> None:
    """The planning process is a rank of a group of its own; the ranks it forks to measure
    links make their own group (they inherit its, which they must not join twice)."""
    from orgel.explicit.device_plan import plan_in_child

    plan = plan_in_child(_plan_after_links, device="cpu", timeout_s=60)
    assert (plan.num_ranks, plan.microbatches, plan.num_stages) == (2, 4, 2)


@pytest.mark.slow
def test_ranks_forked_before_the_callers_capture_train_as_one_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The start of CUDA ranks, run on the CPU: a forked process plans, the ranks fork
    before the caller captures and each prepares by that plan; losses, evaluation and
    weights equal one process."""
    import contextlib
    import copy

    import orgel
    import orgel.explicit.api as api
    import orgel.flow.start as start
    from orgel.models import build

    forked: list[int] = []
    fork_ranks = start.fork_ranks
    monkeypatch.setattr(api, "FORK_FIRST", frozenset({"cpu"}))
    monkeypatch.setattr(start, "fork_ranks",
                        lambda *a, **k: (forked.append(a[2]), fork_ranks(*a, **k))[1])
    # once the ranks forked, the caller captures with its GPUs in sight (hidden, PyTorch
    # may count none and keep the count: the caller could not use CUDA after the pipeline)
    hidden: list[bool] = []
    monkeypatch.setattr(api, "cuda_unused", lambda: (hidden.append(True),
                                                     contextlib.nullcontext())[1])
    w = build("gpt", seq_len=16)
    x, y = w.inputs[0], w.targets
    reference = copy.deepcopy(w.model)
    with orgel.pipeline(w.model, w.inputs, w.targets, w.loss_fn, ranks=2, microbatches=2,
                        device="cpu", optimizer=lambda p: torch.optim.SGD(p, lr=0.1)) as pipe:
        losses = [pipe.step(w.inputs, w.targets) for _ in range(2)]
        evaluated = pipe.evaluate(w.inputs, w.targets)
        state = pipe.state_dict()
    assert forked == [2] and not hidden
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref = []
    for _ in range(2):
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
            loss = w.loss_fn(reference(xs), ys) / 2
            loss.backward()
            total += loss.item()
        opt.step()
        ref.append(total)
    reference.eval()
    with torch.no_grad():
        ref_eval = w.loss_fn(reference(x), y).item()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    assert abs(evaluated - ref_eval) <= 1e-5 * max(1.0, abs(ref_eval))
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)


def test_a_caller_that_hid_its_gpus_is_refused_cuda_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After a capture with the GPUs hidden, PyTorch may keep a GPU count of 0 that forked
    ranks inherit: a CUDA pipeline forked from such a process is refused, saying what to do."""
    import orgel.launch.devices
    from orgel.launch.devices import check_fork

    monkeypatch.setattr(orgel.launch.devices, "HID_GPUS", [True])
    check_fork("cpu")
    with pytest.raises(ValueError, match="a process of its own"):
        check_fork("cuda")
