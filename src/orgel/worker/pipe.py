"""The object a pipeline is driven through: :class:`Pipeline` (step, state, checkpoints).

``orgel.pipeline`` (:mod:`orgel.explicit.api`), ``orgel.backend`` (:mod:`orgel.transparent.backend`)
and the several-graph controller (:mod:`orgel.explicit.glued`) all return one; it talks
to the ranks through a group (:class:`orgel.runtime.launch.LocalGroup` in local
spawn, :class:`OwnRank` under torchrun).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from orgel.runtime import checkpoint as ckpt
from orgel.schedule.ir import Plan
from orgel.worker.engine import RankEngine
from orgel.workload import named_inputs


class OwnRank:
    """SPMD: this process is one rank; ``call`` runs locally and all-gathers the results."""

    def __init__(self, engine: RankEngine, num_ranks: int, *, owns_group: bool) -> None:
        self.engine = engine
        self.num_ranks = num_ranks
        self.owns_group = owns_group

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        import torch.distributed as dist

        result = getattr(self.engine, method)(*args, **kwargs)
        gathered: list[Any] = [None] * self.num_ranks
        dist.all_gather_object(gathered, result)
        return gathered

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def close(self) -> None:
        import torch.distributed as dist

        # a process group left alive can keep a rank from exiting after the script ends
        if self.owns_group and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


class Pipeline:
    """A model pipelined over ``plan.num_ranks`` ranks; see :func:`pipeline`."""

    def __init__(self, plan: Plan, ranks: Any, *, model: torch.nn.Module,
                 loss_ranks: Sequence[int], state_keys: list[str], aliases: dict[str, str],
                 spmd: bool, source: Any = None) -> None:
        self.plan = plan
        # its forward signature names positional inputs; it holds the tensors no stage reads
        self._model = model
        self._ranks = ranks
        self._loss_rank = loss_ranks[0]
        self._state_keys = state_keys
        self._aliases = aliases
        self.spmd = spmd
        self.steps = 0
        # a meta model's values (orgel.split.materialize.Weights): for tensors no stage holds
        self._source = source
        #: ``check(named, targets)`` raising for a batch the stages cannot take, before any
        #: rank starts the step (:func:`orgel.graph.sizes.batch_check`); None: no check
        self.check_batch: Any = None

    @property
    def num_ranks(self) -> int:
        return self.plan.num_ranks

    def step(self, inputs: Any, targets: Any) -> float:
        """Run one training step (forward, backward, optimizer) on a whole batch; the loss."""
        named = named_inputs(self._model, inputs)
        if self.check_batch is not None:
            self.check_batch(named, targets)
        if self.spmd:  # every rank gets the loss from the executor: nothing to gather
            loss = self._ranks.engine.step(named, targets)
        else:
            loss = self._ranks.call("step", named, targets)[self._loss_rank]
        self.steps += 1
        return float(loss)

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
        """The original model's state_dict (same keys and order), gathered from all ranks."""
        merged: dict[str, torch.Tensor] = {}
        for part in self._ranks.call("state_dict"):
            for name, t in part.items():
                merged.setdefault(name, t)
        # Tensors the forward never reads (an unused pooler, a spare buffer) are in no
        # stage; training cannot change them, so the caller's model holds their values.
        own = self._model.state_dict()
        unread = [self._aliases.get(k, k) for k in self._state_keys
                  if self._aliases.get(k, k) not in merged and k in own]
        if self._source is not None and unread:  # a meta model: make them as a rank would
            merged.update({n: t.detach() for n, t in self._source.tensors(unread).items()})
        for key in self._state_keys:
            name = self._aliases.get(key, key)
            if name not in merged and key in own:
                merged[name] = own[key].detach().clone()
        return _in_model_order(merged, self._state_keys, self._aliases)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load an original-model state_dict into every rank's stages (by original names)."""
        self._ranks.call("load_state", dict(state))

    def save(self, directory: str | Path) -> Path:
        """Write a checkpoint of every rank atomically into ``directory``; returns its folder."""
        root = str(directory)
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
                                 aliases=self._aliases)
        if self.spmd:
            self._ranks.barrier()
        return folder

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


def _in_model_order(merged: dict[str, torch.Tensor], keys: list[str],
                    aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        name = aliases.get(key, key)
        if name in merged:
            out[key] = merged[name]
    for name, t in merged.items():  # anything the split added that the model does not list
        if name not in out and name not in aliases.values():
            out[name] = t
    return out


def canonical_names(model: torch.nn.Module) -> dict[int, str]:
    """By id, each parameter's and buffer's first name in ``model`` (a tied one's canonical)."""
    canonical: dict[int, str] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        canonical.setdefault(id(t), name)
    return canonical


def model_aliases(model: torch.nn.Module) -> tuple[list[str], dict[str, str]]:
    """The model's state_dict keys and, for tied tensors, key -> the canonical name."""
    canonical = canonical_names(model)
    keys: list[str] = []
    aliases: dict[str, str] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        keys.append(key)
        name = canonical.get(id(t), key)
        if name != key:
            aliases[key] = name
    return keys, aliases
