"""The object a pipeline is driven through: :class:`Pipeline` (step, evaluate, state, checkpoints).

``orgel.pipeline`` (:mod:`orgel.explicit.api`), ``orgel.backend`` (:mod:`orgel.transparent.backend`)
and the several-graph controller (:mod:`orgel.explicit.glued`) all return one; it talks
to the ranks through a group (:class:`orgel.launch.processes.LocalGroup` in local
spawn, :class:`orgel.worker.own_rank.OwnRank` under torchrun).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from orgel.batching import check_batch, check_same_everywhere
from orgel.launch.errors import StepError
from orgel.launch.interrupts import finishes_first
from orgel.lossweights import Rule
from orgel.parameters import check_trainable, trainable
from orgel.precision import check_around
from orgel.runtime import checkpoint as ckpt
from orgel.runtime.optimizer import StepCount
from orgel.runtime.outputs import merge
from orgel.schedule.ir import Plan
from orgel.worker.engine import kept_results
from orgel.worker.evaluation import LazyEvaluation
from orgel.worker.state import StateNames, canonical_names, model_aliases
from orgel.workload import cache_off, named_inputs

__all__ = ["Pipeline", "canonical_names", "model_aliases"]


Unflatten = Callable[[list[Any]], Any]


class Pipeline(StepCount):
    """A model pipelined over ``plan.num_ranks`` ranks; see :func:`pipeline`.

    ``outputs`` rebuilds the model's output structure from the training stages'
    output leaves (``step(..., outputs=True)``); ``evaluation`` the same for the
    eval-mode stages (``evaluate``), or says why this pipeline cannot evaluate.
    """

    def __init__(self, plan: Plan, ranks: Any, *, model: torch.nn.Module,
                 loss_ranks: Sequence[int], state_keys: list[str], aliases: dict[str, str],
                 spmd: bool, source: Any = None, accumulate: int = 1,
                 workload: Any = None, outputs: Unflatten | None = None,
                 evaluation: Unflatten | str | LazyEvaluation | None = None) -> None:
        self.plan = plan
        # its forward signature names positional inputs; it holds the tensors no stage reads
        self._model = model
        #: which of the model's parameters train, as the ranks were built (checked each step)
        self._trains = trainable(model)
        self._ranks = ranks
        self._loss_rank = loss_ranks[0]
        self._aliases = aliases
        #: the model's state_dict keys and where each is held: the one rule for names
        self._names = StateNames(state_keys, aliases)
        #: values load_state_dict gave tensors no rank holds, by held name
        self._loaded: dict[str, torch.Tensor] = {}
        self.spmd = spmd
        # optimizer steps taken (``steps``; with ``accumulate=k`` one per k step calls), and
        # the calls made since the last one (``pending``): the ranks' rule (StepCount)
        StepCount.__init__(self, accumulate)
        # a meta model's values (orgel.split.materialize.Weights): for tensors no stage holds
        self._source = source
        # the example batch (orgel.workload.Workload) each step's batch is checked against
        self._workload = workload
        self._outputs = outputs
        self._evaluation = ("this pipeline was made without an eval-mode capture"
                            if evaluation is None else evaluation)
        #: ``check(named, targets)`` raising for a batch the stages cannot take, before any
        #: rank starts the step (:func:`orgel.graph.sizes.batch_check`); None: no check
        self.check_sizes: Any = None
        #: how the micro-batches' and replicas' losses weigh (:mod:`orgel.lossweights`)
        self.loss_rule: Rule = "rows"

    @property
    def num_ranks(self) -> int:
        return self.plan.num_ranks

    @finishes_first
    def step(self, inputs: Any, targets: Any = None, *, outputs: bool = False) -> Any:
        """Train on a whole batch; its loss (as ``loss_fn`` on the whole batch in one process).

        ``inputs`` is the batch as the model takes it (a dict such as a ``DataLoader``'s
        ``{input_ids, attention_mask, labels}``, or a tuple); ``targets`` None when the
        labels are in it (the model's own loss, or a ``loss_fn`` that ignores them).

        Forward and backward run on every call; the optimizer (and its schedule)
        steps on every ``accumulate``-th call, after clipping, with the gradients
        of those calls (each call's loss counting ``1/accumulate``).

        ``outputs=True`` returns ``(loss, outputs)``: the model's outputs for the
        whole batch, in micro-batch order, as the model returns them, on this
        process's CPU (see :mod:`orgel.runtime.outputs` for leaves without the batch
        rows, such as a 0-dim tensor: a list per micro-batch). Under torchrun every
        rank gets them. Nothing is sent when they are not asked for.

        A batch the pipeline cannot take (other input names, dtypes, fewer rows than
        micro-batches, targets of another batch size) raises
        :class:`~orgel.workload.WorkloadError` here before any rank sees it. An error
        a rank's work raises for the data's own reason (a target out of range in
        the loss) raises :class:`~orgel.launch.errors.StepError`: every rank dropped
        the step (with ``accumulate`` > 1, the gradients accumulated since the last
        optimizer step too) and the pipeline trains on. A dead or hung rank, or a lost
        connection, raises :class:`~orgel.launch.errors.WorkerError` and ends it.
        """
        named = named_inputs(self._model, inputs)
        if outputs and self._outputs is None:
            raise ValueError("step(..., outputs=True) is not available for this pipeline "
                             "(orgel.backend's runner: compute what you need from the "
                             "outputs inside your closure)")
        self._check_batch(named, targets, "pipe.step")
        try:
            if outputs:
                results = kept_results(self._ranks.call("step", named, targets, outputs=True))
            elif self.spmd:  # every rank gets the loss from the executor: nothing to gather
                loss = kept_results([self._ranks.engine.step(named, targets)])[0]
            else:
                loss = kept_results(self._ranks.call("step", named, targets))[self._loss_rank]
        except StepError:
            self.pending = 0  # every rank dropped the accumulated gradients with the step
            raise
        self.called()
        if outputs:
            assert self._outputs is not None
            shares = [share for _, part in results for share in part]
            return float(results[self._loss_rank][0]), merge(shares, self._outputs)
        return float(loss)

    @finishes_first
    def evaluate(self, inputs: Any, targets: Any = None, *, outputs: bool = False) -> Any:
        """Forward only over a whole batch in eval mode, as one process runs
        ``model.eval(); with torch.no_grad(): loss_fn(model(x), y)``.

        BatchNorm reads its running statistics, dropout is off; nothing records
        gradients, no optimizer steps, no buffer changes, and the next ``step``
        trains exactly as if this evaluation had not run (random streams included).
        Returns the mean loss over the micro-batches (``loss_fn(outputs, targets)``,
        also with ``targets=None``); with ``outputs=True`` the model's outputs as
        ``step`` returns them: ``outputs`` alone when ``targets`` is None (no loss is
        computed), else ``(loss, outputs)``. Under torchrun every rank gets the result.
        The batch may leave out inputs of the example (a Hugging Face batch without
        ``labels``: ``pipe.evaluate({"input_ids": ..., "attention_mask": ...},
        outputs=True).logits``, as the model computes without them): its first
        ``evaluate`` captures the model for those inputs.
        An error a rank's own work raises (a ``loss_fn`` that needs the targets it was not
        given) raises :class:`~orgel.launch.errors.StepError` as in :meth:`step`: every
        rank dropped the pass, and the pipeline goes on.
        """
        named = named_inputs(self._model, inputs)
        self._check_batch(named, targets, "pipe.evaluate")
        # the first evaluate (of a batch of these inputs) makes the eval-mode split: each
        # rank its own, and this process only where it needs the outputs' structure (under
        # torchrun the rank's serves both); a loss alone waits for no capture here
        unflatten: Any = self._evaluation
        if isinstance(self._evaluation, LazyEvaluation) and (outputs or self.spmd):
            made = self._evaluation.get(named)
            unflatten = made if isinstance(made, str) else made.unflatten_outputs
        if isinstance(unflatten, str):
            raise RuntimeError(f"evaluation is not available: {unflatten}")
        loss = targets is not None or not outputs
        if self.spmd and not outputs:  # the loss is reduced to every rank: nothing to gather
            return kept_results([self._ranks.engine.evaluate(named, targets, loss=True,
                                                             outputs=False)], "evaluate")[0][0]
        results = kept_results(self._ranks.call("evaluate", named, targets, loss=loss,
                                                outputs=outputs), "evaluate")
        value = results[self._loss_rank][0]
        if not outputs:
            return value
        assert callable(unflatten)  # (made above)
        out = merge([share for _, part in results for share in part], unflatten)
        return (value, out) if loss else out

    @property
    def stepping(self) -> bool:
        """Whether the step call being made is one the optimizer steps on (every
        ``accumulate``-th: :attr:`StepCount.final`, the ranks' rule)."""
        return self.final

    def called(self) -> None:
        """Count a step call made on the ranks: every ``accumulate``-th is an optimizer step."""
        self.advance()

    @property
    def lr(self) -> list[float]:
        """The learning rates in force for the next optimizer step, one per param group."""
        rates = self._ask("lr")
        return [] if rates is None else list(rates)

    @property
    def grad_norm(self) -> float | None:
        """The last optimizer step's global gradient norm over all ranks, before clipping
        (as ``torch.nn.utils.clip_grad_norm_`` returns it); None before the first step.
        """
        norm = self._ask("grad_norm")
        return None if norm is None else float(norm)

    @property
    def compile_s(self) -> list[float]:
        """Seconds each rank has spent compiling its stages (``compile=True``; by process;
        under torchrun this rank's alone). Zero without compiling."""
        if self.spmd:
            return [float(self._ranks.engine.compile_seconds())]
        return [float(s) for s in self._ranks.call("compile_seconds")]

    def _ask(self, method: str) -> Any:
        """The first rank's answer that is not None (every rank that has one agrees)."""
        if self.spmd:  # this rank's own answer: no collective
            answers = [getattr(self._ranks.engine, method)()]
        else:
            answers = self._ranks.call(method)
        return next((a for a in answers if a is not None), None)

    def _check_batch(self, named: dict[str, Any], targets: Any, call: str) -> None:
        """Refuse, here and before any rank sees it, a batch the pipeline cannot take, and a
        ``call`` under a grad mode or autocast the ranks do not run (``check_around``)."""
        w = self._workload
        check_around(call, getattr(w, "precision", None), trains=call == "pipe.step")
        if call == "pipe.step":
            check_trainable(self._model, self._trains)
        if w is not None:
            example_targets = None if targets is None else w.targets  # evaluate(x) alone
            # what orgel adds (use_cache=False) is no input the user passed, nor in messages
            added = cache_off(w.model, {})

            def given(inputs: dict[str, Any]) -> dict[str, Any]:
                return {k: v for k, v in inputs.items() if k not in added or v is not added[k]}

            example = given(named_inputs(w.model, w.inputs))
            if call == "pipe.evaluate":  # without some of the example's inputs (labels): an
                # eval-mode capture of its own (orgel.worker.evaluation)
                example = {k: v for k, v in example.items() if k in named}
            check_batch((example, example_targets), (given(named), targets),
                        self.plan.microbatches, w.batch_dim, w.replicated, self.plan.row_unit)
        if self.check_sizes is not None:  # sizes the stages cannot take (orgel.graph.sizes)
            self.check_sizes(named, targets)
        if self.spmd:  # (torchrun, orgel run's ranks) every process passes this batch
            check_same_everywhere(self._ranks.gather, named, targets, call)

    def predicted(self) -> Any:
        """The prediction for this plan (a SimResult: step_time, peak_memory, timeline, ...).

        The simulator's timeline of the plan; the step time and peak memory are
        the ones the planner stored in ``plan.prediction`` when it chose the plan
        (they add what no action covers: the optimizer and the step's closing
        all-reduce, the sends and receive buffers the runtime holds), so both
        report one number.
        """
        from orgel.sim import simulate

        sim = simulate(self.plan)
        stored = self.plan.prediction or {}
        sim.step_time += float(stored.get("end_of_step", 0.0))
        if stored.get("peak_memory") is not None:
            sim.peak_memory = [int(b) for b in stored["peak_memory"]]
        return sim

    def timeline(self) -> list[Any]:
        """The measured events of the last step, every rank merged (orgel.runtime.trace.Event)."""
        events = [e for part in self._ranks.call("timeline") for e in part]
        return sorted(events, key=lambda e: (e.start, e.rank))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``model.state_dict()``'s keys in its order (tied aliases included), gathered.

        Tensors no stage reads (an unused pooler, a spare buffer) are on no rank:
        training cannot change them, so they come from the caller's model (or the
        last :meth:`load_state_dict`). Non-persistent buffers and the constants
        capture lifts into the stages are not in the model's state_dict: not here.
        """
        merged: dict[str, torch.Tensor] = {}
        for part in self._ranks.call("state_dict"):
            for name, t in part.items():
                merged.setdefault(name, t)
        merged.update(self._unread(set(merged)))
        return self._names.in_model_order(merged)

    def _unread(self, held: set[str]) -> dict[str, torch.Tensor]:
        """The tensors of the model's state no rank holds, by held name."""
        names = [n for n in self._names.held_names() if n not in held]
        out = {n: self._loaded[n] for n in names if n in self._loaded}
        names = [n for n in names if n not in out]
        if not names:
            return out
        if self._source is not None:  # a meta model: make them as a rank would
            out.update({n: t.detach() for n, t in self._source.tensors(names).items()})
            return out
        own = self._model.state_dict()
        out.update({n: own[n].detach().clone() for n in names if n in own})
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor],
                        strict: bool = True) -> Any:
        """Load a state_dict of the model into every rank's stages, as ``model.load_state_dict``.

        With ``strict``, missing and unexpected keys raise RuntimeError here (in
        torch's words, listing them); a shape that differs from the model's always
        does. Nothing is sent to the ranks before the state passed the checks, so a
        refused state changes nothing and the pipeline trains on. Returns torch's
        ``(missing_keys, unexpected_keys)`` named tuple.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"load_state_dict expects a dict of tensors (a state_dict), got "
                            f"{type(state).__name__}")
        shapes = {k: t.shape for k, t in self._model.state_dict(keep_vars=True).items()}
        result = self._names.check(state, shapes, strict=strict,
                                   owner=f"the pipeline of {type(self._model).__name__}")
        held = self._names.to_held(state)
        loaded = {n for part in self._ranks.call("load_state", held) for n in part}
        self._loaded.update({n: t.detach().clone() for n, t in held.items() if n not in loaded})
        return result

    def copy_to(self, model: torch.nn.Module | None = None) -> torch.nn.Module:
        """Write the trained values into ``model`` (default: the model given to the pipeline).

        Afterwards ``model.state_dict()`` equals :meth:`state_dict` (a ``torch.compile``'d
        model: the module it wraps). Under torchrun
        call it on every rank (it gathers): each rank's model is fully updated.
        Returns ``model``.
        """
        return self._write_into(model, self.state_dict())

    def _write_into(self, model: torch.nn.Module | None,
                    state: Mapping[str, torch.Tensor]) -> torch.nn.Module:
        """:meth:`copy_to`'s writing of ``state`` (this process's copy of the trained values)."""
        from orgel.workload import on_meta, plain_module

        target = self._model if model is None else plain_module(model)
        if on_meta(target):
            raise ValueError(
                "copy_to cannot write into a model on the meta device (it has no memory for "
                "values): take pipe.state_dict(), save a checkpoint with pipe.save(DIR) and "
                "export it with `orgel checkpoint export DIR OUT`, or pass a model with values "
                "(copy_to(model))")
        target.load_state_dict(state, strict=True)
        return target if model is None else model

    @finishes_first
    def save(self, directory: str | Path, *, keep: int | None = None) -> Path:
        """Write a checkpoint of every rank atomically into ``directory``; returns its folder.

        Each save is a folder ``step-NNNNNNNN`` under ``directory``. ``keep``: None (the
        default) removes no older checkpoint; ``keep=k`` removes, once this one is
        complete, all but the newest ``k`` (this one among them) of those in ``directory``.
        """
        ckpt.check_keep(keep)  # before any rank writes
        if self.pending:
            raise ckpt.CheckpointError(
                f"pipe.save in the middle of an accumulation ({self.pending} of "
                f"{self.accumulate} step calls made since the last optimizer step): their "
                "gradients are not in a checkpoint. Save after the optimizer steps, when "
                "pipe.steps has grown")
        root = str(directory)
        if self.spmd:  # one folder for every rank's shard
            ckpt.check_same_folder(self._ranks.gather(os.path.abspath(root)))
        Path(root).mkdir(parents=True, exist_ok=True)
        step = self.steps
        written = self._ranks.call("save_shard", root, step)
        failed = [(r, w["error"]) for r, w in enumerate(written) if isinstance(w, dict)]
        if failed:  # nothing is committed; the ranks train on
            if not self.spmd or _own_rank() == 0:
                shutil.rmtree(ckpt.staging_dir(root, step), ignore_errors=True)
            try:
                latest = f"{ckpt.resolve(root)} is still the latest complete checkpoint"
            except ckpt.CheckpointError:
                latest = "no complete checkpoint exists there yet"
            r, why = failed[0]
            raise ckpt.CheckpointError(
                f"saving the checkpoint of step {step} in {root} failed on rank {r} ({why}); "
                f"nothing was committed and {latest}. The pipeline can go on training: free "
                "space or choose another directory, then save again")
        folder = ckpt.step_dir(root, step)
        if not self.spmd or _own_rank() == 0:
            folder = ckpt.commit(root, step, self.num_ranks, self.plan.to_json(),
                                 aliases=self._aliases, keys=self._names.keys,
                                 unread=self._unread, keep=keep)
        if self.spmd:
            self._ranks.barrier()
        return folder

    @finishes_first
    def load(self, directory: str | Path) -> int:
        """Resume from the checkpoint in ``directory`` (any plan, any rank count); its step."""
        meta = ckpt.read_meta(directory)
        saved_plan = Plan.from_json(ckpt.read_plan_json(directory))
        same = (int(meta["num_ranks"]) == self.num_ranks
                and saved_plan.to_dict()["schedule"] == self.plan.to_dict()["schedule"]
                and saved_plan.placement == self.plan.placement)
        read = self._ranks.call("read_checkpoint", str(ckpt.resolve(directory)),
                                same_layout=same)
        failed = [(r, w["error"]) for r, w in enumerate(read) if w]
        if failed:  # no rank applied anything: the pipeline trains on as it was
            r, why = failed[0]
            raise ckpt.CheckpointError(f"rank {r} cannot resume: {why}. No rank's state "
                                       f"changed; the pipeline is still at step {self.steps}")
        steps = self._ranks.call("apply_checkpoint")
        self.steps = int(steps[0])
        self.pending = 0
        return self.steps

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the local-spawn workers by rank (empty under torchrun)."""
        return list(getattr(self._ranks, "pids", []))

    @property
    def loss_scale(self) -> dict[str, Any] | None:
        """Under ``precision="16-mixed"``: ``{"scale", "growth_tracker", "skipped"}`` after the
        last step (``skipped``: its gradients held an inf/NaN and no rank stepped); else None.
        """
        return self.ranks_loss_scale()

    def ranks_loss_scale(self) -> dict[str, Any] | None:
        """:attr:`loss_scale`, asked of the ranks inside another call (under torchrun, not a
        call of process 0's that the other processes make too)."""
        states = [s for s in self.call_ranks("loss_scale") if s is not None]
        return states[0] if states else None

    def call_ranks(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``method`` of every rank's engine (:class:`orgel.worker.engine.RankEngine`); by rank.

        The seam the closure runners (:mod:`orgel.transparent.backend`,
        :mod:`orgel.explicit.glued`) drive their steps through.
        """
        return list(self._ranks.call(method, *args, **kwargs))

    def kill(self) -> None:
        """Stop the local-spawn ranks at once (a micro-batch they wait on failed here)."""
        kill = getattr(self._ranks, "kill", None)
        if kill is not None:
            kill()

    @property
    def closed(self) -> bool:
        """Whether the local-spawn ranks were stopped (:meth:`close`, :meth:`kill`)."""
        return bool(getattr(self._ranks, "closed", False))

    def close(self) -> None:
        """Stop the workers (local spawn); the pipeline cannot be used afterwards."""
        self._ranks.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _own_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
