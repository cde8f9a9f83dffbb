"""A model built on the meta device that keeps how its constructor computed its buffers.

On the meta device a constructor's buffers have shapes but no values: position ids from
``torch.arange``, a causal mask from ``torch.tril``, rotary ``inv_freq``. Built inside
:func:`build_on_meta`, every op on a meta tensor is recorded (a ``TorchDispatchMode``), and
each rank remakes the buffers of its own stages on its device by running again the
recorded ops they came from, and only those (:func:`replay`), as torchdistX's deferred
initialization does. So ``init`` sets weights only::

    with orgel.build_on_meta():
        model = MyModel(config)
    pipe = orgel.pipeline(model, x, y, loss_fn, ranks=4, init=my_weight_init)

Parameters are not replayed: they get ``reset_parameters()`` and ``init`` as on any meta
model (:mod:`orgel.split.materialize`). Ops on tensors made outside the block (a
``model.half()`` after it, say) are not recorded; a buffer made by them is replayed by
no one and ``init`` must write it, as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

#: each recorded tensor's recording (a tensor dropped drops its entry)
_RECORDED: WeakIdKeyDictionary = WeakIdKeyDictionary()


@dataclass(frozen=True)
class _Ref:
    """A recorded meta tensor among an op's arguments (by id; the recording keeps it)."""
    key: int


@dataclass
class _Op:
    func: Any
    args: Any  # args and kwargs as a pytree, meta tensors as _Ref, others as constants
    outs: list[int]  # ids of the tensors it returned
    groups: set[int] = field(default_factory=set)  # alias groups it makes or writes
    reads: set[int] = field(default_factory=set)  # alias groups of its tensor arguments


class Recording:
    """The ops of one :func:`build_on_meta` block, in order, and which tensors alias."""

    def __init__(self) -> None:
        self.ops: list[_Op] = []
        self.group: dict[int, int] = {}  # id(tensor) -> its alias group (the base's id)
        self.kept: list[torch.Tensor] = []  # every recorded tensor: their ids stay theirs

    def _known(self, t: torch.Tensor) -> bool:
        return id(t) in self.group

    def add(self, func: Any, args: Any, out: Any) -> None:
        leaves, spec = pytree.tree_flatten(args)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if any(t.is_meta and not self._known(t) for t in tensors):
            return  # a tensor from outside the block: what it makes cannot be replayed
        stored = [_Ref(id(x)) if isinstance(x, torch.Tensor) and x.is_meta
                  else x.detach().clone() if isinstance(x, torch.Tensor) else x
                  for x in leaves]
        reads = {self.group[id(t)] for t in tensors if t.is_meta}
        writes = {self.group[id(a)] for a in _written(func, args) if self._known(a)}
        results = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        view_of = _view_base(func, args)
        outs = []
        for t in results:
            if not self._known(t):
                base = view_of if view_of is not None and self._known(view_of) else t
                self.group[id(t)] = self.group[id(base)] if base is not t else id(t)
                self.kept.append(t)
                _RECORDED[t] = self
            outs.append(id(t))
        if not outs and not writes:
            return
        self.ops.append(_Op(func, pytree.tree_unflatten(stored, spec), outs,
                            {self.group[k] for k in outs} | writes, reads))

    def replay(self, tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """``tensors`` (made in this recording) made again on ``device``."""
        needed = {self.group[id(t)] for t in tensors}
        chosen = []
        for op in reversed(self.ops):  # every op that makes or writes what is needed
            if op.groups & needed:
                chosen.append(op)
                needed |= op.reads | op.groups
        made: dict[int, torch.Tensor] = {}

        def real(x: Any) -> Any:
            if isinstance(x, _Ref):
                return made[x.key]
            if isinstance(x, torch.device) and x.type == "meta":
                return device
            if isinstance(x, torch.Tensor):
                return x.to(device)
            return x

        with torch.no_grad():
            for op in reversed(chosen):
                args, kwargs = pytree.tree_map(real, op.args, is_leaf=lambda x: isinstance(
                    x, _Ref))
                out = op.func(*args, **kwargs)
                results = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
                made.update(zip(op.outs, results, strict=True))
        return [made[id(t)] for t in tensors]


def _written(func: Any, args: Any) -> list[torch.Tensor]:
    """The tensor arguments ``func`` writes (in-place and ``out=`` ops)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    positional, kwargs = args
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = positional[i] if i < len(positional) else kwargs.get(arg.name)
        written += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


def _view_base(func: Any, args: Any) -> torch.Tensor | None:
    """The argument a view op's result aliases (None for an op that makes new memory)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    positional, kwargs = args
    alias = schema.returns[0].alias_info
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.before_set == alias.before_set:
            value = positional[i] if i < len(positional) else kwargs.get(arg.name)
            return value if isinstance(value, torch.Tensor) else None
    return None


class _Recorder(TorchDispatchMode):
    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.recording.add(func, (args, kwargs), out)
        return out


@contextmanager
def build_on_meta() -> Iterator[Recording]:
    """Inside, tensors are made on the meta device and every op on them is recorded, so
    that each rank can make the buffers a constructor computes (:func:`replay`)."""
    recording = Recording()
    with torch.device("meta"), _Recorder(recording):
        yield recording


def replayable(t: torch.Tensor) -> bool:
    """Whether ``t`` was made inside a :func:`build_on_meta` block."""
    return t in _RECORDED


def replay(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """The meta tensor ``t`` made again on ``device`` by the ops it came from."""
    (made,) = _RECORDED[t].replay([t], torch.device(device))
    return made
