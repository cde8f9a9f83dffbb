"""Dynamo's options while orgel traces a forward (capture, glued graphs, the backend)."""

from __future__ import annotations

import logging
from typing import Any

import torch

#: Log calls in a forward that capture skips rather than break the graph at (the
#: ``*_once`` ones are what transformers adds to ``logging.Logger``).
_LOG_METHODS = ("debug", "info", "warning", "warning_once", "info_once")


def dynamo_settings() -> Any:
    """Dynamo's options while orgel traces a forward (capture, and ``orgel.backend``'s steps).

    They avoid graph breaks that need not happen: ``allow_rnn`` traces
    ``nn.LSTM``/``GRU``/``RNN`` as ops, and log calls in the forward (Longformer's
    "Initializing global attention on CLS token") are skipped instead of breaking.
    """
    calls = {getattr(logging.Logger, name) for name in _LOG_METHODS
             if hasattr(logging.Logger, name)}
    options: dict[str, Any] = {"allow_rnn": True, "ignore_logging_functions": calls}
    if hasattr(torch._dynamo.config, "log_compilation_metrics"):
        # torch 2.11 logs each compile's config and fails to sort that set of functions
        options["log_compilation_metrics"] = False
    return torch._dynamo.config.patch(**options)
