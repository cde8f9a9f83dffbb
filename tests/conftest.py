"""Shared test settings: one intra-op thread in the test process.

The machine has two cores and the multi-process tests put one rank on each; a
test process that also spreads its own ops over every core only adds contention
(measured: the capture/split tests went from 3 min 44 s to 24 s).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty profile cache (``$ORGEL_CACHE``) for this test."""
    monkeypatch.setenv("ORGEL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"
