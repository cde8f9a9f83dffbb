"""Shared test settings: one intra-op thread in the test process; process-starting tests are slow.

The machine has two cores and the multi-process tests put one rank on each; a
test process that also spreads its own ops over every core only adds contention
(measured: the capture/split tests went from 3 min 44 s to 24 s).

Every test that starts a process (forked or spawned ranks, a subprocess) must
carry the ``slow`` marker, so that ``pytest -m "not slow"`` stays a quick
single-process run: a test without it that starts one fails, saying so.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> Iterator[None]:
    # matplotlib builds its font cache on first import by running fc-list; on a fresh
    # machine that subprocess would be charged to whichever quick test draws first.
    import matplotlib.font_manager  # noqa: F401

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _default_dtype_left_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test starts with torch's default dtype, float32.

    Once (CI, the transformers 4.57 leg) a test began with the default dtype float64, left
    so by an earlier test in its worker that was never found; it built its reference model
    in float64 and its step-0 loss was another one. A test that changes the default dtype
    gets a warning naming it, and the next test starts from float32 again. So does a test
    that begins with another default dtype (set at collection, or by a thread an earlier
    test left running: the setting is the process's, not a thread's).
    """
    if torch.get_default_dtype() != torch.float32:
        request.node.warn(pytest.PytestWarning(
            f"this test began with torch's default dtype {torch.get_default_dtype()}; "
            "set to float32"))
        torch.set_default_dtype(torch.float32)
    yield
    if torch.get_default_dtype() != torch.float32:
        request.node.warn(pytest.PytestWarning(
            f"this test left torch's default dtype {torch.get_default_dtype()}; restored"))
        torch.set_default_dtype(torch.float32)


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty profile cache (``$ORGEL_CACHE``) for this test."""
    monkeypatch.setenv("ORGEL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(autouse=True)
def _process_starting_tests_are_marked_slow(request: pytest.FixtureRequest,
                                            monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    started: list[str] = []
    start = multiprocessing.process.BaseProcess.start
    popen = subprocess.Popen.__init__

    def recording_start(self: Any) -> None:
        started.append(f"process {self.name}")
        start(self)

    def recording_popen(self: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
        started.append(f"subprocess {str(args)[:60]}")
        popen(self, args, *rest, **kwargs)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", recording_start)
    monkeypatch.setattr(subprocess.Popen, "__init__", recording_popen)
    yield
    if started:
        pytest.fail(f"{request.node.nodeid} starts {started[0]} but is not marked slow: add "
                    "@pytest.mark.slow (or pytestmark = pytest.mark.slow for the module)")


def pytest_configure(config: pytest.Config) -> None:
    """Refuse ``--dist loadgroup`` where pytest-xdist cannot group: its 3.8 (and earlier)
    marks a group in a node id that pytest 9 no longer reads, so it silently sends a group's
    tests to both workers and the work they share runs twice (measured 2026-12-05 under
    pytest 9.2: the matrix's 200 s of torchrun jobs ran on each worker)."""
    if getattr(config.option, "dist", "no") != "loadgroup":
        return
    import xdist

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())

    if version(pytest.__version__) >= (9,) and version(xdist.__version__) <= (3, 8):
        raise pytest.UsageError(
            f"pytest-xdist {xdist.__version__} does not group tests (--dist loadgroup) under "
            f"pytest {pytest.__version__}: install pytest<9 (pip install -e '.[dev]' pins it)")


@pytest.hookimpl(trylast=True)  # after -m and -k took their tests out
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give the session's torchrun pool the parts of the tests selected (and only those)."""
    selected = [(m.args[0], item.module) for item in items
                for m in item.iter_markers("torchrun_part")]
    config.stash[_POOL_PARTS] = selected


_POOL_PARTS = pytest.StashKey[list[tuple[str, Any]]]()


@pytest.fixture(scope="session")
def torchrun_pool(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The selected tests' scripts, run once in one torchrun job (``tests/torchrun_pool.py``)."""
    from torchrun_pool import Pool

    pool = Pool(tmp_path_factory.mktemp("torchrun-pool"))
    for name, module in request.config.stash.get(_POOL_PARTS, []):
        pool.add(name, module)
    return pool


@pytest.fixture()
def torchrun_part(request: pytest.FixtureRequest, torchrun_pool: Any) -> Path:
    """This test's part's folder, after the shared torchrun job ran it."""
    marker = request.node.get_closest_marker("torchrun_part")
    assert marker is not None, "torchrun_part needs @pytest.mark.torchrun_part(name)"
    return Path(torchrun_pool.folder(marker.args[0]))
