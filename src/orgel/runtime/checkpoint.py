"""Checkpoints: per-rank shards written atomically, resumable under any plan or rank count.

Layout of a checkpoint root ``DIR``::

    DIR/LATEST                  name of the newest complete checkpoint, e.g. "step-00000012"
    DIR/step-00000012/meta.json format, step, number of ranks, which shard holds which name
    DIR/step-00000012/plan.json the Plan the run used (JSON, see orgel.schedule.ir)
    DIR/step-00000012/rank0.pt  rank 0's shard (torch.save of plain dicts, lists and tensors)
    DIR/step-00000012/unread.pt the model's tensors no stage reads (no rank holds them)

A save writes every shard into ``step-N.tmp/``, then :func:`commit` renames the
folder to ``step-N`` and replaces ``LATEST`` with ``os.replace``; only then are
older folders removed. A crash at any point leaves ``LATEST`` naming a complete
checkpoint. Shards hold only tensors, numbers, strings, lists and dicts, so they
load with ``torch.load(weights_only=True)``; nothing is pickled.

Every tensor is keyed by its qualified name in the ORIGINAL model, never by a
stage-local name. That is what lets a checkpoint be exported to a plain
``state_dict`` and resumed under a different plan or rank count: each rank
picks the names it now hosts from whichever shard has them.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from orgel.runtime.sharding import full_tensor, shard_like

FORMAT = "orgel-checkpoint"
VERSION = 1
LATEST = "LATEST"
UNREAD = "unread.pt"
_STEP_RE = re.compile(r"^step-(\d{8})$")

NamedTensors = list[tuple[str, torch.Tensor]]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the model being resumed."""


# -- optimizer state by original name -------------------------------------------------


def named_optimizer_state(
    optimizer: torch.optim.Optimizer, params: NamedTensors
) -> dict[str, Any]:
    """The optimizer's state keyed by original parameter names instead of integer ids.

    ``params`` lists ``(original name, parameter)`` for every parameter the
    optimizer holds. Groups keep their hyper-parameters and list names.
    """
    name_of = {id(p): n for n, p in params}
    state: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        names = []
        for p in group["params"]:
            if id(p) not in name_of:
                raise CheckpointError("the optimizer holds a parameter that has no original name")
            name = name_of[id(p)]
            names.append(name)
            if p in optimizer.state:
                state[name] = {  # a sharded state whole (full_tensor gathers it)
                    k: compact(full_tensor(v)) if isinstance(v, torch.Tensor) else v
                    for k, v in optimizer.state[p].items()
                }
        hyper = {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()}
        hyper["params"] = names
        groups.append(hyper)
    return {"state": state, "groups": groups}


def load_named_optimizer_state(
    optimizer: torch.optim.Optimizer,
    params: NamedTensors,
    named: dict[str, Any],
) -> None:
    """Load :func:`named_optimizer_state` output into ``optimizer``, matching by name.

    The saved state may come from other ranks (merged by :func:`read_names`):
    every parameter finds its state by original name. The groups must be the
    saved ones (:func:`check_groups`), so each group takes the hyper-parameters
    of the saved group of the same index: the group its parameters were in.
    """
    check_groups(optimizer, params, named)
    id_of = {id(p): i for i, (_, p) in enumerate(params)}
    current = optimizer.state_dict()
    saved_groups = named.get("groups", [])
    new_groups = []
    for gi in range(len(optimizer.param_groups)):
        base = dict(current["param_groups"][gi])
        if gi < len(saved_groups):
            for k, v in saved_groups[gi].items():
                if k != "params" and k in base:
                    base[k] = tuple(v) if isinstance(base[k], tuple) else v
        new_groups.append(base)
    # state_dict()'s integer ids enumerate params in group order
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    names = [params[id_of[id(p)]][0] for p in flat]
    # a sharded parameter's state comes back as this rank's shard of it
    new_state = {
        i: {k: shard_like(p, v) if isinstance(v, torch.Tensor) else v
            for k, v in named["state"][name].items()}
        for i, (p, name) in enumerate(zip(flat, names, strict=True)) if name in named["state"]
    }
    optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})


def saved_group_of(named: dict[str, Any]) -> dict[str, int]:
    """Each parameter's group index in saved optimizer state, by original name."""
    if "group_of" in named:
        return dict(named["group_of"])
    return {n: gi for gi, g in enumerate(named.get("groups", [])) for n in g["params"]}


def check_groups(optimizer: torch.optim.Optimizer, params: NamedTensors,
                 named: dict[str, Any]) -> None:
    """Raise :class:`CheckpointError` unless ``optimizer`` groups ``params`` as saved.

    Every parameter of ``params`` must be in the group of the same index as when
    the checkpoint was saved (or in none, both times), and the group counts must
    agree: group hyper-parameters and a scheduler's per-group state are restored
    by index, so another grouping would hand a group another's learning rate or
    weight decay. A checkpoint that saved no groups is not checked.
    """
    saved = named.get("groups") or []
    if not saved:
        return
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(saved)} parameter groups, this one has "
            f"{len(optimizer.param_groups)}: build the optimizer's groups as when it was "
            "saved (the same factory)")
    was = saved_group_of(named)
    now = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    for name, p in params:
        before, after = was.get(name), now.get(id(p))
        if before != after:
            def where(gi: int | None) -> str:
                return "in no group" if gi is None else f"in group {gi}"
            raise CheckpointError(
                f"parameter {name!r} is {where(after)} of the optimizer but was "
                f"{where(before)} when the checkpoint was saved: build the optimizer's "
                "groups as when it was saved (the same factory), or each group would "
                "take another group's hyper-parameters")


# -- shards -------------------------------------------------------------------------------


def check_same_folder(folders: list[str]) -> None:
    """Raise :class:`CheckpointError` naming the folders when the ranks of one pipeline (under
    torchrun, ``folders[r]`` is rank r's, made absolute) do not save into one folder."""
    if len(set(folders)) < 2:
        return
    ranks: dict[str, list[int]] = {}
    for r, folder in enumerate(folders):
        ranks.setdefault(folder, []).append(r)
    seen = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {folder}"
                     for folder, rs in ranks.items())
    raise CheckpointError(
        f"the ranks passed different folders to pipe.save ({seen}); a checkpoint is one "
        "folder that every rank writes its shard into, so nothing was written. Pass the same "
        "folder on every rank (a fixed path, or rank 0's tempfile.mkdtemp() sent to the "
        "others with torch.distributed.broadcast_object_list); the pipeline can go on training")


def step_dir(root: str | Path, step: int) -> Path:
    """The folder of the checkpoint at ``step`` under ``root``."""
    return Path(root) / f"step-{step:08d}"


def staging_dir(root: str | Path, step: int) -> Path:
    """Where shards of the checkpoint at ``step`` are written before :func:`commit`."""
    return Path(root) / f"step-{step:08d}.tmp"


def make_shard(
    *,
    rank: int,
    step: int,
    params: NamedTensors,
    buffers: NamedTensors,
    optimizer: dict[str, Any] | None,
    rng: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One rank's shard as plain data (tensors on the CPU, :func:`compact`: it is written
    before the rank trains on; keyed by original names)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "rank": rank,
        "step": step,
        "params": {n: compact(t) for n, t in params},
        "buffers": {n: compact(t) for n, t in buffers},
        "optimizer": optimizer,
        "rng": rng,
        "extra": extra or {},
    }


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached: itself where it is a CPU tensor that fills its storage (no second copy
    of a rank's state), else a copy on the CPU of its own size (``torch.save`` writes a
    view's whole storage: a stage's flat buffer)."""
    t = t.detach()
    whole = (t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0
             and t.untyped_storage().nbytes() == t.numel() * t.element_size())
    return t if whole else t.to("cpu", copy=True)


def write_shard(root: str | Path, step: int, rank: int, shard: dict[str, Any]) -> Path:
    """Write ``shard`` into the staging folder of ``step`` (temp file, then rename)."""
    folder = staging_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}.pt"
    tmp = folder / f".rank{rank}.pt.partial"
    try:
        with open(tmp, "wb") as f:
            torch.save(shard, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # a partial file is worth nothing, and takes space
        raise
    os.replace(tmp, path)
    return path


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit(
    root: str | Path,
    step: int,
    num_ranks: int,
    plan_json: str,
    *,
    keep: int | None = None,
    aliases: dict[str, str] | None = None,
    keys: list[str] | None = None,
    unread: Callable[[set[str]], dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Seal the staged checkpoint at ``step`` once every rank has written its shard.

    Writes meta.json and plan.json, renames the staging folder and points ``LATEST``
    at it. ``keep``: None (the default) leaves every older checkpoint in place; an int
    ``k >= 1`` then removes all but the newest ``k`` complete checkpoints (by step),
    never the one just committed (:func:`check_keep` says what is valid).
    ``aliases`` maps extra state_dict keys of the original model (tied tensors)
    to the name the shards store them under, so :func:`state_dict` lists both.
    ``keys``: the model's state_dict keys in order (:func:`state_dict` returns
    exactly those). ``unread(held)``: the model's tensors outside the names the
    shards hold (tensors no stage reads), written to ``unread.pt``.
    """
    kept = check_keep(keep)  # before anything is committed
    root = Path(root)
    staged = staging_dir(root, step)
    shards = [f"rank{r}.pt" for r in range(num_ranks)]
    missing = [s for s in shards if not (staged / s).exists()]
    if missing:
        raise CheckpointError(f"cannot commit step {step}: shards {missing} were not written")
    owners: dict[str, list[int]] = {}
    for r in range(num_ranks):
        shard = torch.load(staged / f"rank{r}.pt", weights_only=True, map_location="cpu")
        for name in list(shard["params"]) + list(shard["buffers"]):
            owners.setdefault(name, []).append(r)
    extra = unread(set(owners)) if unread is not None else {}
    if extra:
        torch.save({n: t.detach().to("cpu") for n, t in extra.items()}, staged / UNREAD)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "num_ranks": num_ranks,
        "shards": shards,
        "plan": "plan.json",
        "owners": owners,
        "aliases": dict(aliases or {}),
        "unread": sorted(extra),
    }
    if keys is not None:
        meta["keys"] = list(keys)
    _write_text_atomic(staged / "plan.json", plan_json.rstrip("\n") + "\n")
    _write_text_atomic(staged / "meta.json", json.dumps(meta, indent=1) + "\n")
    final = step_dir(root, step)
    # At every instant LATEST names a complete checkpoint, whatever crashes in between.
    previous = None
    if final.exists():  # re-saving the same step: LATEST moves to a linked copy first
        previous = root / f"{final.name}.old"
        shutil.rmtree(previous, ignore_errors=True)
        shutil.copytree(final, previous, copy_function=os.link)
        _write_text_atomic(root / LATEST, previous.name + "\n")
        shutil.rmtree(final)
    os.replace(staged, final)
    _fsync_dir(root)
    _write_text_atomic(root / LATEST, final.name + "\n")
    _fsync_dir(root)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
    if kept is not None:
        complete = sorted(p for p in root.iterdir() if _STEP_RE.match(p.name))
        for old in complete[: max(0, len(complete) - kept)]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def check_keep(keep: int | None) -> int | None:
    """``keep`` as :func:`commit` takes it, or a :class:`CheckpointError` saying what to give."""
    if keep is None:
        return None
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise CheckpointError(
            f"keep={keep!r}: give how many of the newest checkpoints to keep (an int >= 1; "
            "the one just saved counts), or keep=None (the default) to remove none")
    return keep


def _fsync_dir(folder: Path) -> None:
    """Make the renames inside ``folder`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading ------------------------------------------------------------------------------


def resolve(path: str | Path) -> Path:
    """The complete checkpoint folder that ``path`` names: a root (via LATEST) or a step folder."""
    path = Path(path)
    if (path / "meta.json").exists():
        return path
    pointer = path / LATEST
    if not pointer.exists():
        raise CheckpointError(
            f"no checkpoint in {path}: expected {path / LATEST} or {path / 'meta.json'}; "
            "save one with pipe.save(DIR) first"
        )
    target = path / pointer.read_text().strip()
    if not (target / "meta.json").exists():
        raise CheckpointError(f"{pointer} names {target.name}, which is incomplete")
    return target


def read_meta(path: str | Path) -> dict[str, Any]:
    """meta.json of the checkpoint at ``path`` (checked for format and version)."""
    folder = resolve(path)
    meta: dict[str, Any] = json.loads((folder / "meta.json").read_text())
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(
            f"{folder} is not an orgel checkpoint of version {VERSION} "
            f"(format {meta.get('format')!r}, version {meta.get('version')!r})"
        )
    return meta


def read_plan_json(path: str | Path) -> str:
    """The plan JSON stored with the checkpoint at ``path``."""
    return (resolve(path) / "plan.json").read_text()


def read_shard(path: str | Path, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s shard, loaded with ``weights_only=True`` onto the CPU."""
    folder = resolve(path)
    file = folder / f"rank{rank}.pt"
    try:
        shard: dict[str, Any] = torch.load(file, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint shard {file} is missing: the checkpoint is "
                              f"incomplete{_other_checkpoints(folder)}") from None
    except pickle.UnpicklingError as exc:  # weights_only refused a pickled object
        raise CheckpointError(
            f"checkpoint shard {file} holds Python objects that weights_only loading refuses "
            f"({str(exc).splitlines()[0][:200]}): it was not written by orgel, or was replaced; "
            f"orgel never unpickles code{_other_checkpoints(folder)}") from None
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint shard {file} is incomplete or corrupt ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else 'no detail'})"
            f"{_other_checkpoints(folder)}") from None
    if not isinstance(shard, dict) or "params" not in shard:
        raise CheckpointError(f"checkpoint shard {file} is not an orgel shard (no 'params')")
    return shard


def _other_checkpoints(folder: Path) -> str:
    """``"; complete checkpoints beside it: ..."`` for a message (empty when there are none)."""
    others = sorted(p.name for p in folder.parent.glob("step-*")
                    if p != folder and (p / "meta.json").exists())
    if not others:
        return "; no other complete checkpoint is beside it"
    return (f"; the newest other complete checkpoint is {folder.parent / others[-1]} "
            "(load that step folder)")


def read_names(path: str | Path, names: Iterable[str]) -> dict[str, Any]:
    """Parameters, buffers and optimizer state for ``names``, merged from the shards.

    Returns ``{"params", "buffers", "optimizer": {"state", "groups", "group_of"}, "step"}``
    (``group_of``: each name's saved group index, from the shard that holds it);
    raises :class:`CheckpointError` naming any name no shard holds.
    """
    meta = read_meta(path)
    wanted = set(names)
    missing = sorted(wanted - set(meta["owners"]))
    if missing:
        raise CheckpointError(
            f"checkpoint has no tensor for {missing[:5]}{'...' if len(missing) > 5 else ''}: "
            "was it saved from a different model?"
        )
    ranks = sorted({meta["owners"][n][0] for n in wanted})
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    opt_state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    group_of: dict[str, int] = {}
    for r in ranks or [0]:
        shard = read_shard(path, r)
        params.update({n: t for n, t in shard["params"].items() if n in wanted})
        buffers.update({n: t for n, t in shard["buffers"].items() if n in wanted})
        opt = shard.get("optimizer") or {}
        opt_state.update({n: s for n, s in opt.get("state", {}).items() if n in wanted})
        group_of.update({n: gi for n, gi in saved_group_of(opt).items() if n in wanted})
        if not groups:
            groups = opt.get("groups", [])
    return {
        "params": params,
        "buffers": buffers,
        "optimizer": {"state": opt_state, "groups": groups, "group_of": group_of},
        "step": int(meta["step"]),
    }


def state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The original model's ``state_dict`` from a checkpoint: its keys in its order.

    Tensors no stage read come from ``unread.pt``. A checkpoint that recorded
    the model's keys gives exactly those (non-persistent buffers and lifted
    constants the stages hold are left out); an older one every name, sorted.
    """
    meta = read_meta(path)
    out: dict[str, torch.Tensor] = {}
    for r in range(int(meta["num_ranks"])):
        shard = read_shard(path, r)
        for name, t in list(shard["params"].items()) + list(shard["buffers"].items()):
            out.setdefault(name, t)
    if meta.get("unread"):
        file = resolve(path) / UNREAD
        try:
            rest = torch.load(file, weights_only=True, map_location="cpu")
        except (FileNotFoundError, pickle.UnpicklingError, RuntimeError, EOFError) as exc:
            raise CheckpointError(f"{file} (the tensors no stage reads) cannot be read "
                                  f"({type(exc).__name__}): the checkpoint is incomplete") from None
        for name, t in rest.items():
            out.setdefault(name, t)
    aliases: dict[str, str] = meta.get("aliases", {})
    if "keys" in meta:
        return {k: out[aliases.get(k, k)] for k in meta["keys"] if aliases.get(k, k) in out}
    for alias, name in aliases.items():
        if name in out:
            out[alias] = out[name]
    return dict(sorted(out.items()))


def export(path: str | Path, out: str | Path) -> int:
    """Write the original model's state_dict from the checkpoint at ``path`` to ``out``.

    Returns the number of tensors written. Load it with
    ``model.load_state_dict(torch.load(out, weights_only=True))``.
    """
    sd = state_dict(path)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.partial")
    torch.save(sd, tmp)
    os.replace(tmp, out)
    return len(sd)
