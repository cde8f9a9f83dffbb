"""Each rank's optimizer step: parameter groups by name, learning-rate schedule, accumulation.

A user's loop in one process does::

    opt = make_optimizer(named_groups(model.named_parameters()))
    sched = make_scheduler(opt)
    for call, (x, y) in enumerate(batches):
        (loss_fn(model(x), y) / k).backward()
        if (call + 1) % k == 0:
            clip_grad_norm_(model.parameters(), max_norm)
            opt.step(); sched.step(); opt.zero_grad()

Every rank of a pipeline does the same over its own parameters, and the
ranks agree because they run one rule from one set of options:

* the optimizer factory receives :class:`NamedParameters`, the rank's
  parameters with their names in the original model, so a factory that groups
  by name (no weight decay on biases and norms) builds the same groups on
  every rank (a group may be empty on a rank);
* the schedule (a ``torch.optim.lr_scheduler`` factory, or a function ``step ->
  learning rate``) is built over every rank's optimizer and stepped after every
  optimizer step, so every rank's rates follow it alike;
* with ``accumulate=k`` each step call runs forward and backward of its batch,
  gradients add up over ``k`` calls (each call's loss counts ``1/k``) and only
  the ``k``-th reduces them across ranks, clips and steps
  (:class:`OptimizerLoop`).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from orgel.parameters import NamedParameters, probe_parameters

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], LRScheduler]
LearningRate = Callable[[int], float]


def check_loop_options(*, optimizer: OptimizerFactory, scheduler: Any, lr: Any,
                       max_grad_norm: Any, accumulate: Any) -> None:
    """Raise ValueError for training-loop options ``orgel.pipeline``/``orgel.backend`` cannot take.

    A scheduler factory is tried on the optimizer ``optimizer`` builds over
    :func:`probe_parameters`, so a factory that returns no LRScheduler fails
    here, in the caller, before any rank starts.
    """
    if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
        raise ValueError(f"accumulate must be a positive int (optimizer steps on every k-th "
                         f"step call), got {accumulate!r}")
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool)
                                      or not isinstance(max_grad_norm, int | float)
                                      or math.isnan(max_grad_norm) or max_grad_norm <= 0):
        raise ValueError(f"max_grad_norm must be a positive number (clip the global gradient "
                         f"norm to it) or None, got {max_grad_norm!r}")
    if scheduler is not None and lr is not None:
        raise ValueError("give scheduler= or lr=, not both: lr= is a function step -> learning "
                         "rate that sets every group's rate; scheduler= builds a "
                         "torch.optim.lr_scheduler over each rank's optimizer")
    if lr is not None:
        if not callable(lr):
            raise ValueError(f"lr must be a function step -> learning rate, got {lr!r}; a "
                             "constant rate goes in the optimizer factory "
                             "(lambda params: torch.optim.AdamW(params, lr=...))")
        first = lr(0)
        if isinstance(first, bool) or not isinstance(first, int | float):
            raise ValueError(f"lr(0) returned {first!r}: lr must return the learning rate of "
                             "a step as a float")
    made = check_optimizer(optimizer)
    if scheduler is not None:
        if not callable(scheduler):
            raise ValueError("scheduler must be a function optimizer -> "
                             "torch.optim.lr_scheduler.LRScheduler, e.g. lambda opt: "
                             "torch.optim.lr_scheduler.LambdaLR(opt, warmup)")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check_scheduler(scheduler(made))


def check_optimizer(optimizer: OptimizerFactory) -> torch.optim.Optimizer:
    """The optimizer ``optimizer`` builds over :func:`probe_parameters`; ValueError where it
    builds none (nothing with ``param_groups`` and ``step``), or one whose ``step`` needs a
    closure (LBFGS evaluates the loss several times a step): each rank steps its optimizer
    once per optimizer step, without one."""
    given = probe_parameters()
    made = optimizer(given)
    if not (hasattr(made, "param_groups") and callable(getattr(made, "step", None))):
        raise ValueError(f"optimizer returned {type(made).__name__}, not an optimizer: the "
                         "factory takes a rank's parameters and returns its optimizer, e.g. "
                         "lambda params: torch.optim.AdamW(params, lr=1e-3)")
    ids = {id(p) for p in given}
    foreign = [p for g in made.param_groups for p in g["params"] if id(p) not in ids]
    if foreign:
        raise ValueError(
            f"the optimizer factory built an optimizer over {len(foreign)} tensors it was not "
            f"given (the first of shape {tuple(foreign[0].shape)}): each rank calls it with the "
            "parameters of its own stages, which are not your model's (model.parameters() "
            "there is not what the rank trains); build it over the parameters the factory "
            "gets, e.g. lambda params: torch.optim.AdamW(params, lr=1e-3), grouping them by "
            "params.named() where you group by model.named_parameters()")
    try:
        closure = inspect.signature(type(made).step).parameters.get("closure")
    except (TypeError, ValueError):  # a step whose signature cannot be read
        return made
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(f"optimizer returned {type(made).__name__}, whose step needs a "
                         "closure that computes the loss again (several forwards and "
                         "backwards a step); each rank steps its optimizer once per step on "
                         "the gradients the pipeline made: use a first-order optimizer (SGD, "
                         "Adam, AdamW, ...)")
    return made


def check_scheduler(made: Any) -> None:
    """Raise ValueError unless ``made`` is a scheduler the pipeline can step after every step."""
    if isinstance(made, ReduceLROnPlateau):
        raise ValueError("scheduler returned ReduceLROnPlateau, which steps on a metric the "
                         "pipeline does not have; give a schedule by step (LambdaLR, "
                         "CosineAnnealingLR, ...) or set the rate from your loop with lr=")
    if not isinstance(made, LRScheduler):
        raise ValueError(f"scheduler returned {type(made).__name__}, not a "
                         "torch.optim.lr_scheduler.LRScheduler: the factory takes the "
                         "optimizer and returns its scheduler, e.g. lambda opt: "
                         "torch.optim.lr_scheduler.LambdaLR(opt, warmup)")


class StepCount:
    """Step calls and optimizer steps: the one rule of when the optimizer steps.

    With ``accumulate=k`` every k-th step call is an optimizer step (:attr:`final`); the
    calls between accumulate gradients. Each rank's :class:`OptimizerLoop` and the
    caller's :class:`~orgel.worker.pipe.Pipeline` count with it.
    """

    def __init__(self, accumulate: int = 1) -> None:
        self.accumulate = accumulate
        self.steps = 0  # optimizer steps taken (the schedule's position)
        self.pending = 0  # step calls since the last optimizer step

    @property
    def final(self) -> bool:
        """Whether the step call being made is an optimizer step."""
        return self.pending + 1 >= self.accumulate

    def advance(self) -> bool:
        """Count the step call being made; whether it was an optimizer step."""
        if self.final:
            self.pending = 0
            self.steps += 1
            return True
        self.pending += 1
        return False


class OptimizerLoop(StepCount):
    """One rank's optimizer with its schedule and accumulation count.

    The executor asks :attr:`final` whether the current step call is the one
    that reduces, clips and steps (the ``accumulate``-th since the last step),
    starts each backward from :meth:`loss_gradient`, and calls :meth:`begin` at
    the start of every call and :meth:`finish` at its end.
    """

    def __init__(self, named: NamedParameters, factory: OptimizerFactory | None, *,
                 scheduler: SchedulerFactory | None = None, lr: LearningRate | None = None,
                 accumulate: int = 1) -> None:
        self.params = list(named)
        self.optimizer = factory(named) if factory is not None and named else None
        self.scheduler: LRScheduler | None = None
        if self.optimizer is not None and scheduler is not None:
            made = scheduler(self.optimizer)
            check_scheduler(made)
            self.scheduler = made
        self.lr = lr
        super().__init__(accumulate)
        #: micro-batch losses this rank back-propagated since the last optimizer step
        #: (none on any rank: no gradient exists, as after no ``backward`` in one process)
        self.graded = 0
        self._set_rate()

    def begin(self) -> None:
        """Start a step call: a new accumulation drops the gradients of the last step."""
        if self.pending == 0:
            self.graded = 0
            for p in self.params:
                p.grad = None

    def loss_gradient(self, loss: torch.Tensor, scale: torch.Tensor | None) -> Any:
        """The gradient a micro-batch's loss starts its backward from (None: one).

        ``1/accumulate`` times the loss scale, as ``(scaler.scale(loss) / k).backward()``.
        """
        if scale is None and self.accumulate == 1:
            return None
        grad = torch.ones((), dtype=loss.dtype, device=loss.device) if scale is None else scale
        if self.accumulate > 1:
            grad = grad / self.accumulate
        return grad.to(loss.dtype).expand_as(loss)

    def finish(self, *, skipped: bool = False) -> None:
        """End a step call; on the :attr:`final` one step the optimizer and the schedule.

        ``skipped`` (the gradients held an inf/NaN under loss scaling): the
        optimizer does not step but the schedule moves on, as a plain loop that
        calls ``scheduler.step()`` after ``scaler.step(opt)`` does.
        """
        if not self.advance():
            return
        if self.optimizer is not None and not skipped:
            self.optimizer.step()
        if self.scheduler is not None:
            with warnings.catch_warnings():
                # a skipped first step: torch warns that the scheduler stepped first
                warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
                self.scheduler.step()
        self._set_rate()

    def _set_rate(self) -> None:
        if self.lr is not None and self.optimizer is not None:
            rate = float(self.lr(self.steps))
            for group in self.optimizer.param_groups:
                group["lr"] = rate

    def rates(self) -> list[float] | None:
        """The learning rates in force for the next step, one per group (None: no optimizer)."""
        if self.optimizer is None:
            return None
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def groups(self) -> int | None:
        """How many parameter groups the optimizer has (None: no optimizer on this rank)."""
        return None if self.optimizer is None else len(self.optimizer.param_groups)

    def state_dict(self) -> dict[str, Any]:
        """The schedule's position and state (the optimizer's is saved by name elsewhere)."""
        return {"steps": self.steps,
                "scheduler": None if self.scheduler is None else self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any], steps: int) -> None:
        """Resume at optimizer step ``steps`` (the scheduler's own state when it was saved).

        Gradients accumulated since the last optimizer step are dropped.
        """
        self.pending = 0
        self.steps = int(state.get("steps", steps))
        saved = state.get("scheduler")
        if self.scheduler is not None and saved is not None:
            self.scheduler.load_state_dict(saved)
        elif self.scheduler is not None:
            raise ValueError("the checkpoint holds no learning-rate scheduler state; it was "
                             "saved by a pipeline without scheduler=")
        self._set_rate()
