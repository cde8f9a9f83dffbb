"""The fuzzer's second entry point: a drawn setup through ``torch.compile(backend=orgel.backend)``.

:func:`start` builds the backend with the setup's options, its family as ``schedule=`` (a
balanced chain of the backend's own capture, as :func:`fuzzing.make_plan` makes for
``orgel.pipeline``) and one recompute policy for every stage, and returns it with a ``step``
that trains one batch as a user's loop would: the compiled model called in a closure on
each micro-batch share, its loss weighed by its share of the batch's rows
(``loss / shares`` where the batch divides; ``pipe.scale(...)`` under float16, GradScaler's
idiom) and ``.backward()``, ``pipe.step(closure, *batch)``; with
``no_backward``, some step calls' closures skip the backward (``Setup.skips_backward``).
Its loss is the batch's, as ``orgel.pipeline``'s ``step`` returns it, so both entry
points are judged against the same one-process run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import orgel
from fuzz_loop import share_weight
from orgel.batching import batch_rows
from orgel.lossweights import weigh
from orgel.workload import named_inputs


def start(setup: Any, w: Any, optimizer: Callable[..., Any], loop: dict[str, Any],
          recompute: bool | str, timeout_s: float) -> tuple[Any, Callable[[Any, Any], float]]:
    """The backend for ``setup`` (a :class:`fuzzing.Setup`) and its ``step(inputs, targets)``."""
    shares = setup.microbatches * setup.dp  # closures per step: dp replicas share them
    family = {} if setup.schedule == "auto" else {"schedule": setup.schedule}
    keys = list(named_inputs(w.model, w.inputs))
    whole = [keys.index(name) for name in w.replicated]  # step's arguments taken whole
    pipe = orgel.backend(ranks=setup.ranks, tp=setup.tp, dp=setup.dp, shard=setup.shard,
                         sequence_parallel=setup.sequence_parallel,
                         batch_dim=w.batch_dim, replicated=whole,
                         microbatches=shares, threads=1, optimizer=optimizer,
                         timeout_s=timeout_s, recompute=recompute, compile=setup.compile,
                         **family,
                         **loop)
    compiled = torch.compile(w.model, backend=pipe, dynamic=setup.dynamic)
    cast = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(setup.precision)

    def closure(*args: Any) -> float:
        *values, targets = args
        named = dict(zip(keys, values, strict=True))
        # mixed precision as one process runs it: the forward and the loss under autocast
        # (which computes cross-entropy in float32); precision= alone leaves the loss to the
        # closure
        with torch.autocast("cpu", dtype=cast or torch.bfloat16, enabled=cast is not None):
            loss = w.loss_fn(compiled(**named), targets)
        # this piece's part of the batch (a batch that does not divide: tensor_split's cut)
        weight = share_weight(batch_rows(named, targets, w.batch_dim, w.replicated), w.rows)
        if not setup.skips_backward(calls[0]):  # (an evaluation batch: no backward)
            # accumulate=k: the backend counts each 1/k
            pipe.scale(weigh(loss, weight)).backward()
        return float(weigh(loss.detach(), weight))

    calls = [0]  # step calls made

    def step(inputs: Any, targets: Any) -> float:
        try:
            return float(sum(pipe.step(closure, *named_inputs(w.model, inputs).values(),
                                       targets)))
        finally:
            calls[0] += 1

    return pipe, step
