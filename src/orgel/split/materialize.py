"""Real tensors for the stages a rank holds of a model built on the meta device.

A model built under ``with torch.device("meta"):`` has shapes and no values;
``orgel.pipeline(model, ..., init=fn)`` or ``weights=...`` says where its values
come from. Each rank asks a :class:`Weights` for the tensors of its own stages
only (by the original model's names), on its own device, and
:func:`materialize_stages` puts them into its stage modules; no process ever
holds the whole model.

* ``init``: every module that holds one of the wanted tensors is copied (its
  children stay on meta), its tensors are allocated, it is reset as its
  constructor would (``reset_parameters()``, where it has one) and ``init(module)``
  runs on it, in ``model.apply`` order (children first), under a random seed of
  its own: :func:`module_seed` of the base seed and the module's qualified name.
  So a tensor's values depend on the seed and its module's name only, not on
  the plan, the rank or which other modules a rank holds. A tensor neither
  writes (a buffer the constructor computes: a causal mask, position ids) is
  reported by name (:class:`MaterializeError`), never left as a placeholder:
  float tensors start as NaN, others are tracked (assigned, or written in place).
  The meta module recorded no constructor arguments, so its constructor cannot
  be re-run for them: ``init`` (or ``weights``) must give them.
* ``weights``: a dict name -> tensor, a ``torch.save``d state_dict (opened with
  ``mmap=True``: only the tensors read are paged in) or safetensors files (each
  rank reads only its names). A tied tensor may be stored under any of its names.
  With ``init`` as well, ``init`` fills what ``weights`` lacks.
"""

from __future__ import annotations

import contextlib
import copy
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from orgel.split.deferred import replay, replayable
from orgel.split.types import SplitModel

Init = Callable[[torch.nn.Module], Any]
WeightsArg = Mapping[str, torch.Tensor] | str | Path | Sequence[str | Path]


class MaterializeError(ValueError):
    """A meta model's tensors cannot be made: the message says which and what to change."""


def module_seed(seed: int, module: str) -> int:
    """The random seed ``init`` runs under for the module named ``module``."""
    return (int(seed) * 1_000_003 + zlib.crc32(module.encode())) % (2**63)


def _apply_order(module: torch.nn.Module,
                 prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """Modules as ``module.apply`` visits them: children first, then the module."""
    for name, child in module.named_children():
        yield from _apply_order(child, f"{prefix}{name}.")
    yield prefix.rstrip("."), module


def _direct(module: torch.nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """``(attribute, tensor, is parameter)`` the module holds itself (not its children's)."""
    out = [(k, t, True) for k, t in module._parameters.items() if t is not None]
    return out + [(k, t, False) for k, t in module._buffers.items() if t is not None]


class Weights:
    """Where a meta model's values come from: ``init``, ``weights`` or both (see module doc)."""

    def __init__(self, model: torch.nn.Module, *, init: Init | None = None,
                 weights: WeightsArg | None = None, seed: int = 0) -> None:
        if init is None and weights is None:
            raise MaterializeError(
                "the model is on the meta device (it has shapes, no values): pass init= (a "
                "function applied to each module, e.g. init=model._init_weights or init=lambda "
                "m: None for the modules' own reset_parameters) or weights= (a state_dict, a "
                "torch.save file or safetensors files) so that each rank can make its tensors")
        if init is not None and not callable(init):
            raise MaterializeError("init must be a function module -> None, applied to each "
                                   "module as model.apply(init) would")
        self.model, self.init, self.seed = model, init, int(seed)
        self.tensor_of: dict[str, torch.Tensor] = {}  # canonical name -> the meta tensor
        self.names_of: dict[int, list[str]] = {}  # id(tensor) -> every name it has
        for name, t in [*model.named_parameters(remove_duplicate=False),
                        *model.named_buffers(remove_duplicate=False)]:
            names = self.names_of.setdefault(id(t), [])
            if not names:
                self.tensor_of[name] = t
            names.append(name)
        self.store = None if weights is None else _Store(weights)

    def canonical(self, t: torch.Tensor) -> str | None:
        """The first name of the model's tensor ``t`` (None: not the model's)."""
        names = self.names_of.get(id(t))
        return names[0] if names else None

    def tensors(self, names: Sequence[str], device: torch.device | str = "cpu"
                ) -> dict[str, torch.Tensor]:
        """The tensors named ``names`` (canonical names) with their values, on ``device``.

        Parameters come back as ``torch.nn.Parameter`` (``requires_grad`` as in the model).
        """
        device = torch.device(device)
        unknown = [n for n in names if n not in self.tensor_of]
        if unknown:
            raise MaterializeError(f"the model has no parameter or buffer {unknown[:5]}")
        out: dict[str, torch.Tensor] = {}
        missing: list[str] = []
        for name in names:
            meta = self.tensor_of[name]
            stored = None if self.store is None else self.store.find(self.names_of[id(meta)])
            if stored is None:
                missing.append(name)
                continue
            if tuple(stored.shape) != tuple(meta.shape):
                raise MaterializeError(
                    f"weights hold {name} with shape {tuple(stored.shape)} but the model's "
                    f"{name} has shape {tuple(meta.shape)}: give weights saved from this model "
                    "(same configuration)")
            out[name] = _like(meta, stored.to(device=device, dtype=meta.dtype, copy=True))
        for name in [n for n in missing if self.init is None
                     and _replayed_buffer(self.tensor_of[n])]:  # else init may write it too
            out[name] = _like(self.tensor_of[name], replay(self.tensor_of[name], device))
            missing.remove(name)
        if missing and self.init is None:
            raise MaterializeError(
                f"weights have no tensor for {len(missing)} of the model's names, e.g. "
                f"{missing[:5]} (the weights hold e.g. {self.store.sample() if self.store else []}"
                "); give weights with every parameter and buffer, or init= as well to "
                "initialize the rest")
        if missing:
            out.update(self._initialized(missing, device))
        return {name: out[name] for name in names}

    def _initialized(self, names: Sequence[str], device: torch.device) -> dict[str, torch.Tensor]:
        wanted = {id(self.tensor_of[n]) for n in names}
        real: dict[int, torch.Tensor] = {}
        seen: set[int] = set()
        placed: dict[int, tuple[torch.Tensor, int]] = {}  # placeholder id -> (it, version)
        for mname, module in _apply_order(self.model):
            if id(module) in seen or not any(id(t) in wanted for _, t, _ in _direct(module)):
                continue
            seen.add(id(module))
            real.update(self._init_module(mname, module, real, placed, device))
        out: dict[str, torch.Tensor] = {}
        for name in names:
            t = real[id(self.tensor_of[name])]
            if _unset(t, placed.get(id(t))):
                raise MaterializeError(_unset_message(name, t))
            out[name] = t
        return out

    def _init_module(self, mname: str, module: torch.nn.Module, real: dict[int, torch.Tensor],
                     placed: dict[int, tuple[torch.Tensor, int]], device: torch.device
                     ) -> dict[int, torch.Tensor]:
        """Allocate a copy of ``module``'s own tensors, reset and init it; new tensors by id.

        Each placeholder allocated goes into ``placed`` with its version counter.
        """
        twin = copy.copy(module)  # its children stay the model's (meta: writes do nothing)
        twin._parameters = dict(module._parameters)
        twin._buffers = dict(module._buffers)
        tables: dict[bool, dict[str, Any]] = {True: twin._parameters, False: twin._buffers}
        for key, t, is_param in _direct(module):
            made = real.get(id(t))
            if made is None and _replayed_buffer(t):  # as its constructor made it
                made = _like(t, replay(t, device))
            elif made is None:
                made = _like(t, _placeholder(t, device))
                placed[id(made)] = (made, made._version)
            tables[is_param][key] = made
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(module_seed(self.seed, mname))
            reset = getattr(twin, "reset_parameters", None)
            if callable(reset):
                reset()
            assert self.init is not None
            self.init(twin)
        made_now: dict[int, torch.Tensor] = {}
        for key, t, is_param in _direct(module):
            now = tables[is_param][key]
            if now is not None:
                made_now[id(t)] = now
        return made_now


def _replayed_buffer(t: torch.Tensor) -> bool:
    return not isinstance(t, torch.nn.Parameter) and replayable(t)


def _placeholder(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """What a tensor holds before reset and init: a value no real one has where the dtype
    has such a value (NaN; an integer type's least value), else zeros (bool)."""
    empty = torch.empty_like(meta, device=device)
    if empty.is_floating_point() or empty.is_complex():
        return empty.fill_(float("nan"))
    if empty.dtype == torch.bool:
        return empty.zero_()
    return empty.fill_(torch.iinfo(empty.dtype).min)


def _unset(t: torch.Tensor, placed: tuple[torch.Tensor, int] | None) -> bool:
    """Whether reset and init left ``t`` as :func:`_placeholder` made it.

    A float tensor is unset while all NaN (writes through ``.data`` count as writes).
    Any other tensor is unset while it is the placeholder object (init did not assign
    a new one) and no in-place op changed it (its version counter did not move) and,
    for integers, every value is still the placeholder's.
    """
    if not t.numel():
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(t.isnan().all())
    if placed is None or placed[0] is not t or t._version != placed[1]:
        return False  # init assigned it, or wrote it in place
    return t.dtype == torch.bool or bool((t == torch.iinfo(t.dtype).min).all())


def _unset_message(name: str, t: torch.Tensor) -> str:
    if t.is_floating_point() or t.is_complex():
        what = "still NaN after reset_parameters() and init on its module"
    else:
        what = (f"a {t.dtype} tensor that reset_parameters() and init on its module did not "
                "write; on the meta device a value its module's constructor computes (a "
                "causal mask, position ids: torch.tril, torch.arange) is not made")
    return (f"init left {name} unset ({what}): build the model inside "
            "`with orgel.build_on_meta():` (each rank then makes such buffers as the "
            "constructor does), or make init set every parameter and buffer of the modules it "
            "is given, a buffer computed in __init__ too (write it in place, e.g. "
            "m.mask.copy_(torch.tril(torch.ones_like(m.mask))), or assign it, e.g. "
            "m.pos = torch.arange(n)), or pass weights= with it")


def _like(meta: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` as the model's tensor ``meta`` is: a Parameter for a parameter."""
    if isinstance(meta, torch.nn.Parameter):
        return torch.nn.Parameter(value.detach(), requires_grad=meta.requires_grad)
    return value.detach()


class _Store:
    """Named tensors read lazily: a dict, a torch.save file (mmap) or safetensors files."""

    def __init__(self, weights: WeightsArg) -> None:
        self.table: Mapping[str, torch.Tensor] | None = None
        self.files: dict[str, str] = {}  # safetensors: name -> file
        if isinstance(weights, Mapping):
            self.table = weights
            return
        paths = [Path(weights)] if isinstance(weights, (str, Path)) else [Path(p) for p in weights]
        if len(paths) == 1 and paths[0].is_dir():
            paths = sorted(paths[0].glob("*.safetensors"))
            if not paths:
                raise MaterializeError(f"weights: {weights} is a folder with no .safetensors "
                                       "file; give the file(s) or a torch.save file")
        for p in paths:
            if not p.is_file():
                raise MaterializeError(f"weights: no file {p}")
        if all(p.suffix == ".safetensors" for p in paths):
            safe_open = _safe_open()
            for p in paths:
                with safe_open(str(p), framework="pt") as f:
                    self.files.update(dict.fromkeys(f.keys(), str(p)))
        elif len(paths) == 1:
            loaded = torch.load(paths[0], map_location="cpu", mmap=True, weights_only=True)
            if not isinstance(loaded, Mapping):
                raise MaterializeError(f"weights: {paths[0]} holds a {type(loaded).__name__}, "
                                       "not a state_dict (name -> tensor)")
            self.table = loaded
        else:
            raise MaterializeError("weights: give one torch.save file or .safetensors files")

    def find(self, names: Sequence[str]) -> torch.Tensor | None:
        """The stored tensor under the first of ``names`` the weights hold."""
        for name in names:
            if self.table is not None and name in self.table:
                return self.table[name]
            if name in self.files:
                with _safe_open()(self.files[name], framework="pt") as f:
                    return f.get_tensor(name)  # type: ignore[no-any-return]
        return None

    def sample(self) -> list[str]:
        keys = list(self.table) if self.table is not None else list(self.files)
        return keys[:5]


def _safe_open() -> Any:
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise MaterializeError("reading .safetensors weights needs the safetensors package: "
                               "pip install safetensors") from exc
    return safe_open


def materialize_stages(split: SplitModel, stages: Sequence[int], weights: Weights,
                       device: torch.device | str = "cpu") -> int:
    """Give ``stages`` of ``split`` real tensors in place of the model's meta ones.

    Every meta parameter and buffer of those stage modules is replaced by its
    real tensor from ``weights``, one object per original tensor (a tied
    parameter two of these stages hold stays one Parameter), under the module
    attribute it had, so the names a rank reports stay the original model's.
    Returns the bytes made.
    """
    slots: list[tuple[dict[str, Any], str, str]] = []  # (table, key, canonical name)
    for s in stages:
        for sub in split.stages[s].module.modules():
            plain = [k for k, v in vars(sub).items() if isinstance(v, torch.Tensor) and v.is_meta]
            if plain:
                raise MaterializeError(
                    f"stage {s} reads a constant tensor on the meta device ({plain[0]}) that "
                    "is no parameter or buffer of the model: make it a buffer "
                    "(module.register_buffer) so that it can be initialized or loaded by name")
            tables: tuple[dict[str, Any], ...] = (sub._parameters, sub._buffers)
            for table in tables:
                for key, t in table.items():
                    if t is None or not t.is_meta:
                        continue
                    name = weights.canonical(t)
                    if name is None:
                        raise MaterializeError(
                            f"stage {s} reads a tensor on the meta device that is no parameter "
                            f"or buffer of the model ({key}, shape {tuple(t.shape)}): register "
                            "it as a buffer so that it can be initialized or loaded by name")
                    slots.append((table, key, name))
    real = weights.tensors(list(dict.fromkeys(n for _, _, n in slots)), device)
    for table, key, name in slots:
        table[key] = real[name]
    return sum(t.numel() * t.element_size() for t in real.values())


@contextlib.contextmanager
def materialized(split: SplitModel, stages: Sequence[int], weights: Weights,
                 device: torch.device | str = "cpu") -> Iterator[int]:
    """:func:`materialize_stages` for the body only: the meta tensors come back after it.

    What the controller profiles a meta model with: one block's tensors at a time.
    """
    before: list[tuple[dict[str, Any], dict[str, Any]]] = [
        (table, dict(table)) for s in stages for sub in split.stages[s].module.modules()
        for table in (sub._parameters, sub._buffers)]
    try:
        yield materialize_stages(split, stages, weights, device)
    finally:
        for table, saved in before:
            table.clear()
            table.update(saved)


def process_memory(*, reset_peak: bool = False) -> dict[str, int]:
    """This process's resident bytes now (``rss``) and at most since the last reset (``peak``).

    Linux: ``VmRSS``/``VmHWM`` of ``/proc/self/status``; ``reset_peak`` first sets
    the peak to the present (``/proc/self/clear_refs``), so that a forked rank's
    peak is its own and not the controller's before the fork.
    """
    if reset_peak:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass
    found: dict[str, int] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) * 1024
    except OSError:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        found = {"VmRSS": peak, "VmHWM": peak}
    return {"rss": found.get("VmRSS", 0), "peak": found.get("VmHWM", 0)}
