"""Sharded, atomic checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is ``DIR/checkpoints/step_000100/``: DCP's shard files and
``.metadata``, ``trainer_state.json`` (whatever JSON the trainer hands over:
step, data position, plan summary), ``rng/rank_<r>.pt`` (each process's RNG)
and the ``COMPLETE`` marker. Tensors are keyed by the model's ordinary
Hugging Face FQNs (``model.model.layers.5.mlp.up_proj.weight`` under the
``model`` section, flattened optimizer state such as
``optim.state.model.layers.5.mlp.up_proj.weight.exp_avg``), so a pipeline
rank saves only its stage's keys and tensor-parallel DTensors save their
shards with the global shape. Every replica holds the whole model, so one
data-parallel replica writes and the others pass an empty state: identical
replicas would only be deduplicated, but replicas of a heterogeneous plan may
hold one tensor whole on one replica and as shards on another, which DCP
cannot write together. Loading asks DCP for exactly the keys (and shards) the
loading rank holds, so a checkpoint loads under any other plan: other pp, tp
or dp, uneven stages, other world size.

Writing is atomic. Every rank writes into ``step_000100.partial``; after a
barrier the coordinator writes the trainer state and the marker, then
renames the directory to ``step_000100``. :func:`latest_checkpoint` only
returns directories with the final name and the marker, so a save killed at
any point never looks valid. All ranks must see one shared file system.

These functions take state dicts and a process group and know nothing about
the trainer; :func:`training_state` and :func:`apply_training_state` are the
bridge from model parts and optimizers to FQN-keyed state dicts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from potluck.errors import ConfigError

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
RNG_DIR = "rng"
PARTIAL_SUFFIX = ".partial"
_STEP_NAME = re.compile(r"^step_(\d+)$")
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def checkpoint_path(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / CHECKPOINTS_DIR / f"step_{step:06d}"


def checkpoint_step(path: str | Path) -> int:
    match = _STEP_NAME.match(Path(path).name)
    if not match:
        raise ConfigError(f"{path}: not a checkpoint directory (expected step_NNNNNN)")
    return int(match.group(1))


def complete_checkpoints(out_dir: str | Path) -> list[Path]:
    """The finished checkpoints under ``out_dir``, oldest first."""
    root = Path(out_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if p.is_dir() and _STEP_NAME.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest finished checkpoint under ``out_dir``; partial or unmarked ones never count."""
    found = complete_checkpoints(out_dir)
    return found[-1] if found else None


def resume_checkpoint(out_dir: str | Path) -> Path:
    """The checkpoint ``--resume`` continues from; a one-line ConfigError if there is none."""
    latest = latest_checkpoint(out_dir)
    if latest is None:
        raise ConfigError(
            f"nothing to resume: no complete checkpoint under {Path(out_dir) / CHECKPOINTS_DIR}"
        )
    return latest


def save_checkpoint(out_dir: str | Path, step: int, state: Mapping[str, Any],
                    trainer_state: Mapping[str, Any],
                    process_group: dist.ProcessGroup | None = None) -> Path:
    """Save ``state`` (nested dicts of tensors, DTensors, numbers) as checkpoint ``step``.

    Every rank of ``process_group`` must call this. Ranks of the writing replica pass
    their part of the state, ranks of other data-parallel replicas pass ``{}``; every
    rank's RNG is saved either way. ``trainer_state`` (JSON-safe) is taken from the
    coordinator (group rank 0). Without an initialized process group it saves from
    this process alone.
    """
    trainer_json = json.dumps(dict(trainer_state), indent=2)  # fails on every rank alike
    final = checkpoint_path(out_dir, step)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    distributed = _distributed()
    coordinator = not distributed or dist.get_rank(process_group) == 0
    if coordinator:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier(process_group)
    with _single_process_is_intended():
        dcp.save(dict(state), checkpoint_id=str(partial), process_group=process_group,
                 no_dist=not distributed)
    _save_rng(partial / RNG_DIR)
    _barrier(process_group)
    if coordinator:
        _commit(partial, final, step, trainer_json)
        log.info("saved checkpoint %s", final)
    _barrier(process_group)
    return final


def _commit(partial: Path, final: Path, step: int, trainer_json: str) -> None:
    """Write the trainer state and the marker, then give the directory its final name."""
    _write_synced(partial / TRAINER_STATE, trainer_json)
    world_size = dist.get_world_size() if _distributed() else 1
    marker = {"step": step, "world_size": world_size,
              "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    _write_synced(partial / MARKER, json.dumps(marker))
    if final.exists():
        stale = final.with_name(final.name + ".old")
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
        partial.rename(final)
        shutil.rmtree(stale)
    else:
        partial.rename(final)
    _fsync_dir(final.parent)


def load_checkpoint(path: str | Path, state: dict[str, Any],
                    process_group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Load checkpoint ``path`` into ``state`` in place; return its trainer state.

    ``state`` holds the keys (and, for DTensors, the shards) this rank needs, already
    allocated; they may be any subset of the saved keys, laid out under any plan.
    A key missing from the checkpoint, or a shape that differs, is a ConfigError
    raised on every rank alike.
    """
    path = Path(path)
    if not (path / MARKER).is_file():
        raise ConfigError(f"{path}: not a complete checkpoint (no {MARKER} marker)")
    problem = _state_problem(state, dcp.FileSystemReader(str(path)).read_metadata())
    problem = _first_problem_on_any_rank(problem, process_group)
    if problem:
        raise ConfigError(f"checkpoint {path} does not fit this model: {problem}")
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=str(path), process_group=process_group,
                 no_dist=not _distributed())
    if not _distributed() or dist.get_rank(process_group) == 0:
        log.info("loaded checkpoint %s", path)
    return read_trainer_state(path)


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / TRAINER_STATE).read_text())


def load_full_state_dict(path: str | Path, section: str = "model") -> dict[str, torch.Tensor]:
    """Every tensor of one section (e.g. ``model``) as full, unsharded CPU tensors.

    Runs in this process alone (no collectives), whatever plan saved the checkpoint.
    """
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    tensors: dict[str, torch.Tensor] = {}
    for flat_key, item in metadata.state_dict_metadata.items():
        object_path = (metadata.planner_data or {}).get(flat_key, (flat_key,))
        if isinstance(item, TensorStorageMetadata) and len(object_path) == 2 \
                and object_path[0] == section:
            tensors[object_path[1]] = torch.empty(item.size, dtype=item.properties.dtype)
    if not tensors:
        raise ConfigError(f"checkpoint {path} has no {section!r} tensors")
    with _single_process_is_intended():
        dcp.load({section: tensors}, checkpoint_id=str(path), no_dist=True)
    return tensors


def prune_checkpoints(out_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` finished checkpoints (``keep_last < 1`` keeps
    them all); call on one rank only."""
    doomed = complete_checkpoints(out_dir)[:-keep_last] if keep_last > 0 else []
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def training_state(parts: Sequence[torch.nn.Module],
                   optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` for this rank's model parts, keyed by FQN.

    One optimizer per part (a rank with several virtual stages has several parts).
    Optimizer state is flattened per parameter, so stages and replicas never clash.
    """
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for part, optimizer in zip(parts, optimizers, strict=True):
        model.update(get_model_state_dict(part, options=_OPTIONS))
        optim.update(get_optimizer_state_dict(part, optimizer, options=_OPTIONS))
    return {"model": model, "optim": optim}


def apply_training_state(parts: Sequence[torch.nn.Module],
                         optimizers: Sequence[torch.optim.Optimizer],
                         state: Mapping[str, Any]) -> None:
    """Put a loaded :func:`training_state` back into the model parts and optimizers."""
    for part, optimizer in zip(parts, optimizers, strict=True):
        model_keys = get_model_state_dict(part, options=_OPTIONS).keys()
        set_model_state_dict(part, {k: state["model"][k] for k in model_keys}, options=_OPTIONS)
        optim_keys = get_optimizer_state_dict(part, optimizer, options=_OPTIONS).keys()
        set_optimizer_state_dict(part, optimizer, {k: state["optim"][k] for k in optim_keys},
                                 options=_OPTIONS)


def load_rng_state(path: str | Path) -> bool:
    """Restore this process's RNG from checkpoint ``path``; False if it saved none for this rank."""
    file = Path(path) / RNG_DIR / f"rank_{_global_rank()}.pt"
    if not file.is_file():
        log.warning("checkpoint %s has no RNG state for rank %d; keeping the seeded RNG",
                    path, _global_rank())
        return False
    saved = torch.load(file, weights_only=True)
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["python"])
    if saved.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
    return True


def _save_rng(directory: Path) -> None:
    directory.mkdir(exist_ok=True)
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": cuda}
    torch.save(state, directory / f"rank_{_global_rank()}.pt")


def _state_problem(state: Mapping[str, Any], metadata: Metadata) -> str | None:
    """The first requested tensor the checkpoint lacks or holds in another shape."""
    saved = metadata.state_dict_metadata
    for key, value in _flat_tensors(state, ""):
        item = saved.get(key)
        if not isinstance(item, TensorStorageMetadata):
            return f"it has no tensor {key!r}"
        if tuple(item.size) != tuple(value.shape):
            return f"{key!r} is {tuple(item.size)} there, {tuple(value.shape)} here"
    return None


def _flat_tensors(state: Mapping[str, Any], prefix: str):
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flat_tensors(value, name + ".")
        elif isinstance(value, torch.Tensor):
            yield name, value


def _first_problem_on_any_rank(problem: str | None,
                               group: dist.ProcessGroup | None) -> str | None:
    """Share each rank's problem so that all ranks raise together instead of hanging."""
    if not _distributed():
        return problem
    problems: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    return next((p for p in problems if p), None)


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Silence DCP's warning that it saves or loads in one process: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _global_rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier(group: dist.ProcessGroup | None) -> None:
    if _distributed():
        dist.barrier(group=group)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as file:
        file.write(text + "\n")
        file.flush()
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
