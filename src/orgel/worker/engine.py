"""One rank's side of a pipeline: its executor, its parameters by original name, its shard.

The :class:`RankEngine` is what both launch modes drive. In local-spawn mode a
forked worker holds one and the controller calls its methods through
:class:`orgel.launch.processes.LocalGroup`; under ``torchrun`` the script holds its
own rank's engine and calls it directly. It owns nothing clever: training is
the runtime's :class:`~orgel.runtime.Executor`, the format is
:mod:`orgel.runtime.checkpoint`; the engine maps between the stage modules' local
parameter names and the original model's names, which is what makes gathered
``state_dict``s and re-sharded resumes possible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from orgel import guard
from orgel.graph import glue
from orgel.runtime import checkpoint as ckpt
from orgel.runtime.optimizer import OptimizerFactory
from orgel.runtime.sharding import full_tensor, own_part, shard_like
from orgel.schedule.ir import Plan
from orgel.split.exchanges import exchange_stages
from orgel.split.types import SplitModel
from orgel.worker.evaluation import LazyEvaluation

__all__ = ["OptimizerFactory", "RankEngine"]


class RankEngine:
    """Rank ``rank``'s executor, optimizer and checkpoint shard for ``plan``."""

    #: whether this engine answers the exchanges of a forward of several graphs (the
    #: closure engine does: the controller runs the Python between the graphs)
    serves_exchanges = False

    def __init__(
        self,
        rank: int,
        plan: Plan,
        split: SplitModel,
        *,
        optimizer: OptimizerFactory | None,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        timeout_s: float = 300.0,
        executor_options: dict[str, Any] | None = None,
        evaluation: SplitModel | str | LazyEvaluation | None = None,
    ) -> None:
        from orgel.runtime.executor import Executor  # late: it pulls in torch.distributed

        if not self.serves_exchanges and exchange_stages(split):
            raise glue.CaptureError("this split joins several graphs of a forward with graph "
                                    "breaks: it trains only through orgel.pipeline (local "
                                    "spawn), whose controller runs the Python between them")
        self.rank = rank
        self.plan = plan
        self.split = split
        self.step_count = 0
        self._read: dict[str, Any] | None = None  # what read_checkpoint read, until applied
        #: a meta model's rank: resident bytes before it made its stages, and the bytes made
        self.made: dict[str, int] = {}
        self.executor = Executor(
            plan, split, rank=rank, loss_fn=loss_fn, optimizer_factory=optimizer,
            timeout=timeout_s, **(executor_options or {}),
        )
        # a forward of several graphs has a controller in the step: it stops at the first error
        self.executor.abandon_on_error = not self.serves_exchanges
        #: the forward-only passes (:mod:`orgel.runtime.forward_only`) by the names of the
        #: inputs they take, made at the first evaluate of such a batch (``evaluation``: the
        #: eval-mode split, or why there is none), or why there is none
        self._passes: dict[tuple[str, ...] | None, Any] = {}
        self._lazy: LazyEvaluation | None = None
        if isinstance(evaluation, LazyEvaluation):
            self._lazy = evaluation
        else:
            self._passes[None] = self._forward_only(evaluation)

    def _forward_only(self, evaluation: SplitModel | str | None) -> Any:
        """The forward-only pass of ``evaluation``, or the sentence why there is none."""
        if not isinstance(evaluation, SplitModel):
            return evaluation or "this pipeline was made without an eval-mode split"
        from orgel.plan.transforms import check_forward
        from orgel.runtime.forward_only import ForwardOnly

        forward, comm = check_forward(self.executor.plan, evaluation)
        return ForwardOnly(self.executor, evaluation, forward, comm)

    def _pass_for(self, names: Any) -> Any:
        """The forward-only pass for a batch of the inputs ``names`` (made on first use)."""
        if self._lazy is None:  # one split, given at the start
            return self._passes[None]
        key = tuple(sorted(names))
        if key not in self._passes:
            self._passes[key] = self._forward_only(self._lazy.get(key))
        return self._passes[key]

    # -- what this rank holds ------------------------------------------------------------

    def stage_indices(self) -> list[int]:
        return self.plan.stages_on(self.rank)

    def named_params(self) -> ckpt.NamedTensors:
        """``(original name, parameter)`` for every parameter copy on this rank."""
        return list(self.executor.named_parameters())

    def named_buffers(self) -> ckpt.NamedTensors:
        out: ckpt.NamedTensors = []
        for s in self.stage_indices():
            stage = self.split.stages[s]
            for local, b in stage.module.named_buffers():
                out.append((stage.buffer_names.get(local, local), b))
        return out

    def tp_shards(self) -> dict[str, tuple[int, ...]]:
        """The shape of this process's part of each parameter split by tensor parallelism."""
        from orgel.runtime.tensor_parallel import sharded

        return {n: tuple(own_part(p).shape) for n, p in self.named_params() if sharded(p)}

    def tp_sequence(self) -> dict[int, tuple[list[str], list[str]]]:
        """By stage: the nodes that ran on this process's slice of the sequence
        (``sequence_parallel``), and those that had to run on whole tensors."""
        return {s: (sorted(getattr(info.stage.module, "tp_sequence_ran", ())),
                    list(getattr(info.stage.module, "tp_sequence_fallbacks", [])))
                for s, info in self.executor.stages.items()}

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        opt: torch.optim.Optimizer | None = getattr(self.executor, "optimizer", None)
        return opt

    # -- training ----------------------------------------------------------------------------

    def step(self, inputs: Any, targets: Any, *,
             outputs: bool = False) -> float | tuple[float, list[Any]] | Dropped:
        """One training step; the batch's mean loss (the executor reduces it to every rank).

        ``outputs``: also this rank's shares of the model's outputs
        (:class:`orgel.runtime.outputs.Share`; none on a rank without the loss stage).
        A step every rank dropped (one rank's own work raised) comes back as
        :class:`Dropped`, not raised: the local launcher stops every rank when a
        method raises, and the ranks train on after a dropped step.
        """
        from orgel.launch.errors import StepAbandoned

        try:
            loss = float(self.executor.step(inputs, targets, outputs=outputs))
        except StepAbandoned as exc:
            self.executor.kept = None
            return Dropped(exc.rank, exc.report)
        self.step_count += 1
        if not outputs:
            return loss
        kept = self.executor.kept or {}
        self.executor.kept = None
        return loss, [kept[m] for m in sorted(kept)]

    def evaluate(self, inputs: Any, targets: Any, *, loss: bool,
                 outputs: bool) -> tuple[float | None, list[Any]]:
        """Forward only, in eval mode (:mod:`orgel.runtime.forward_only`): the mean loss
        (every rank; None without ``loss``) and this rank's shares of the outputs."""
        forward_only = self._pass_for(inputs)  # the first evaluate of these inputs makes it
        if isinstance(forward_only, str):  # said, not raised: the pipeline goes on
            return Unavailable(forward_only)  # type: ignore[return-value]
        from orgel.launch.errors import StepAbandoned

        try:
            result: tuple[float | None, list[Any]] = forward_only.run(
                inputs, targets, loss=loss, outputs=outputs)
        except StepAbandoned as exc:  # every rank dropped it; the pipeline goes on
            return Dropped(exc.rank, exc.report)  # type: ignore[return-value]
        return result

    def lr(self) -> list[float] | None:
        """The learning rates in force for the next optimizer step, one per param group."""
        return self.executor.loop.rates()

    def grad_norm(self) -> float | None:
        """The last optimizer step's global gradient norm before clipping (None: no step yet)."""
        return self.executor.grad_norm

    def compile_seconds(self) -> float:
        """Seconds this rank spent compiling its stages, training and evaluation graphs."""
        passes = [self.executor, *(p for p in self._passes.values() if not isinstance(p, str))]
        return sum(p.compile_seconds() for p in passes)

    def param_groups(self) -> int | None:
        """How many parameter groups this rank's optimizer has (None: no optimizer here)."""
        return self.executor.loop.groups()

    def held_elements(self) -> int:
        """Parameter elements this rank holds: a sharded stage's shards only (each parameter
        object once; :mod:`orgel.runtime.sharding`)."""
        return sum(own_part(p).numel() for p in self.executor.parameters())

    def timeline(self) -> list[Any]:
        """The measured events of the last step on this rank (orgel.runtime.trace.Event)."""
        return list(self.executor.events)

    def memory(self) -> dict[str, int]:
        """This process's resident bytes: ``rss`` now, ``peak`` since the rank started.

        For a rank of a meta model also ``start`` (before it made its stages) and
        ``made`` (the bytes of the tensors it made): ``peak - start`` is what
        holding and training its stages took.
        """
        from orgel.split.materialize import process_memory

        return {**process_memory(), **self.made}

    def loss_scale(self) -> dict[str, Any] | None:
        """The loss scaler's state and whether the last step was skipped (None: no scaling)."""
        scaler = getattr(self.executor, "scaler", None)
        if scaler is None:
            return None
        return {**scaler.state_dict(), "skipped": bool(self.executor.skipped)}

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers by original name, on the CPU."""
        return {
            n: full_tensor(t).detach().to("cpu", copy=True)
            for n, t in self.named_params() + self.named_buffers()
        }

    def load_state(self, tensors: dict[str, torch.Tensor], *, strict: bool = False) -> list[str]:
        """Copy tensors (by held name) into this rank's copies; the names it loaded.

        Names this rank does not hold are skipped; with ``strict``, a name this
        rank holds that ``tensors`` lacks raises KeyError (the controller checks a
        state against the model's keys before it sends it: see
        :class:`orgel.worker.state.StateNames`).
        """
        loaded: list[str] = []
        missing = []
        self.executor.sharding.reshard()  # into the shards, the weights' own objects
        with torch.no_grad():
            for name, t in self.named_params() + self.named_buffers():
                if name in tensors:
                    t.copy_(shard_like(t, tensors[name]))
                    loaded.append(name)
                else:
                    missing.append(name)
        if strict and missing:
            raise KeyError(f"state_dict has no entry for {missing[:5]} (rank {self.rank})")
        return loaded

    def save_shard(self, root: str, step: int) -> str | dict[str, str]:
        """Write this rank's shard of the checkpoint at ``step`` (not yet committed).

        Returns the shard's path, or ``{"error": ...}`` when the file system
        refused it (a full disk): the rank keeps training, and
        :meth:`orgel.worker.pipe.Pipeline.save` reports it without committing.
        """
        params = self.named_params()
        opt = self.optimizer
        shard = ckpt.make_shard(
            rank=self.rank,
            step=step,
            params=[(n, full_tensor(p)) for n, p in params],
            buffers=self.named_buffers(),
            optimizer=None if opt is None else ckpt.named_optimizer_state(opt, _unique(params)),
            rng=guard.rng_state(),
            extra=self._extra_state(),
        )
        if self.executor.member > 0:  # tensor parallel: member 0 writes the rank's shard,
            # whole tensors the members gathered together above
            return str(ckpt.staging_dir(root, step) / f"rank{self.rank}.pt")
        try:
            return str(ckpt.write_shard(root, step, self.rank, shard))
        except OSError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _extra_state(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"loop": {**self.executor.loop.state_dict(),
                                          "calls": self.executor.steps_done}}
        scaler = getattr(self.executor, "scaler", None)
        if scaler is not None:
            extra["loss_scale"] = scaler.state_dict()
        return extra

    def read_checkpoint(self, path: str, *, same_layout: bool) -> dict[str, str] | None:
        """Read, not yet apply, this rank's part of the checkpoint at ``path``.

        A checkpoint this rank cannot read comes back as ``{"error": why}``: every
        rank reads before any applies (:meth:`apply_checkpoint`), so a bad shard
        changes no rank. ``same_layout`` (same plan and rank count) also reads this
        rank's RNG states, which a bit-identical resume needs.
        """
        self._read = None
        self.executor.sharding.reshard()
        names = [n for n, _ in self.named_params()] + [n for n, _ in self.named_buffers()]
        try:
            part = ckpt.read_names(path, names)
            shard: dict[str, Any] = {}
            loop = self.executor.loop
            if (getattr(self.executor, "scaler", None) is not None or same_layout
                    or loop.scheduler is not None):
                # this rank's own shard (rank 0's when the checkpoint had fewer ranks): every
                # shard holds the pipeline's one loss scale and schedule; the RNG state is
                # this rank's
                saved = int(ckpt.read_meta(path)["num_ranks"])
                shard = ckpt.read_shard(path, self.rank if self.rank < saved else 0)
            if self.optimizer is not None:  # the saved grouping, or nothing changes
                ckpt.check_groups(self.optimizer, _unique(self.named_params()),
                                  part["optimizer"])
            if loop.scheduler is not None and not _saved_loop(shard).get("scheduler"):
                return {"error": "the checkpoint holds no learning-rate scheduler state (it "
                                 "was saved by a pipeline without scheduler=): resume it "
                                 "without scheduler=, or give lr= a function of the step"}
        except ckpt.CheckpointError as exc:
            return {"error": str(exc)}
        self._read = {"part": part, "shard": shard, "rng": same_layout}
        return None

    def apply_checkpoint(self) -> int:
        """Load what :meth:`read_checkpoint` read: tensors and optimizer state by name; the step."""
        if self._read is None:
            raise RuntimeError("apply_checkpoint without a successful read_checkpoint")
        part, shard = self._read["part"], self._read["shard"]
        self.load_state({**part["params"], **part["buffers"]}, strict=True)
        opt = self.optimizer
        if opt is not None and (part["optimizer"]["state"] or part["optimizer"]["groups"]):
            ckpt.load_named_optimizer_state(opt, _unique(self.named_params()), part["optimizer"])
        scaler = getattr(self.executor, "scaler", None)
        state = (shard.get("extra") or {}).get("loss_scale")
        if scaler is not None and state is not None:
            scaler.load_state_dict(state)
        if self._read["rng"] and shard.get("rng"):
            guard.set_rng_state(shard["rng"])
        self._read = None
        step = int(part["step"])
        saved = _saved_loop(shard)
        self.executor.loop.load_state_dict(saved, step)
        # the random streams go on from there (one per step call)
        self.executor.steps_done = int(saved.get("calls", step))
        self.step_count = step
        return step


def _saved_loop(shard: dict[str, Any]) -> dict[str, Any]:
    """The optimizer loop's state in a shard (an empty dict when it holds none)."""
    return dict((shard.get("extra") or {}).get("loop") or {})


@dataclass(frozen=True)
class Unavailable:
    """What :meth:`RankEngine.evaluate` returns where this rank has no eval-mode stages:
    why (the caller raises it as its own error)."""

    reason: str


@dataclass(frozen=True)
class Dropped:
    """What :meth:`RankEngine.step` returns for a step every rank dropped: the rank
    whose own error came first, and its line and traceback."""

    rank: int
    report: tuple[str, str]


def kept_results(results: list[Any], call: str = "step") -> list[Any]:
    """The ranks' results of a ``call`` (``"step"``, ``"evaluate"``; one under torchrun, by
    rank in local spawn); raise :class:`~orgel.launch.errors.StepError` in the caller when
    every rank dropped it, and a RuntimeError where a rank has no eval-mode stages."""
    from orgel.launch.errors import step_error

    for r in results:
        if isinstance(r, Unavailable):
            raise RuntimeError(f"evaluation is not available: {r.reason}")
    dropped = [r for r in results if isinstance(r, Dropped)]
    if dropped:
        raise step_error(dropped[0].rank, dropped[0].report, call)
    return results


def _unique(params: ckpt.NamedTensors) -> ckpt.NamedTensors:
    """Drop repeated parameter objects (a tied parameter two stages on one rank share)."""
    seen: set[int] = set()
    out = []
    for n, p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append((n, p))
    return out
