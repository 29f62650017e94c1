"""Sharded, atomic, verified checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is ``DIR/checkpoints/step_000100/``:

- ``shard-0000R-model-00001-of-00001.safetensors``: the tensors rank R-1 wrote
  (DCP's Hugging Face storage writer, one file per writing rank, each chunk's
  offsets in the safetensors header);
- ``values.json``: the state's non-tensor leaves (optimizer param-group settings;
  :mod:`~potluck.runtime.checkpoints.values`);
- ``trainer_state.json``: whatever JSON the trainer hands over (step, data
  position, plan summary);
- ``rng/rank_RRRRR.safetensors``: each process's RNG
  (:mod:`~potluck.runtime.checkpoints.rng`);
- ``manifest.json``: every other file's size and SHA-256
  (:mod:`~potluck.runtime.checkpoints.manifest`), then the ``COMPLETE`` marker.

Nothing is pickled: tensors are safetensors, everything else JSON, and the
reader builds DCP's metadata from the safetensors headers, so loading a
checkpoint from someone else's run directory cannot run code. A checkpoint of
the old format (DCP's pickled ``.metadata``) is refused, never unpickled.

Tensors are keyed by the model's ordinary Hugging Face FQNs
(``model.model.layers.5.mlp.up_proj.weight`` under the ``model`` section,
flattened optimizer state such as
``optim.state.model.layers.5.mlp.up_proj.weight.exp_avg``), so a pipeline
rank saves only its stage's keys and tensor-parallel DTensors save their
shards with the global shape. Every replica holds the whole model, so one
data-parallel replica writes and the others pass an empty state: identical
replicas would only be deduplicated, but replicas of a heterogeneous plan may
hold one tensor whole on one replica and as shards on another, which DCP
cannot write together. Loading asks DCP for exactly the keys (and shards) the
loading rank holds, so a checkpoint loads under any other plan: other pp, tp
or dp, uneven stages, other world size.

Writing is atomic. Every rank writes into ``step_000100.partial`` and hashes
the files it wrote; the coordinator writes the JSON files, the manifest and
the marker, then renames the directory to ``step_000100``.
:func:`latest_checkpoint` only returns directories with the final name and
the marker, so a save killed at any point never looks valid. Before anything
is read, every file is checked against the manifest; :func:`newest_verified`
skips a damaged checkpoint, saying which file is bad, for the newest one that
verifies. All ranks must see one shared file system.

These functions take state dicts and a process group and know nothing about
the trainer; :func:`training_state` and :func:`apply_training_state` are the
bridge from model parts and optimizers to FQN-keyed state dicts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from potluck.errors import ConfigError
from potluck.runtime.checkpoints.manifest import (
    MANIFEST,
    MARKER,
    checkpoint_problem,
    digests,
    file_digest,
    first_problem_on_any_rank,
    manifest_text,
)
from potluck.runtime.checkpoints.names import (  # noqa: F401 - storage's names, as before
    CHECKPOINTS_DIR,
    PARTIAL_SUFFIX,
    STEP_NAME,
    checkpoint_path,
    checkpoint_step,
    is_step_name,
)
from potluck.runtime.checkpoints.rng import save_rng
from potluck.runtime.checkpoints.values import (
    VALUES,
    read_values,
    restore_values,
    settings_problem,
    split_state,
    values_problem,
    values_text,
)
from potluck.runtime.grads.master_weights import MASTER
from potluck.safe_files import (
    check_no_link,
    output_error,
    real_dir,
    remove_tree,
    sync_dir,
    write_text,
    writing,
)
from potluck.yamlio import read_text

log = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class UnusableCheckpoint(ConfigError):
    """A checkpoint that verifies and fits the model but holds a state no run can continue
    from (a plain value of another type, an optimizer setting no optimizer steps with, a
    tensor that is not finite): an older one may do."""


def complete_checkpoints(out_dir: str | Path) -> list[Path]:
    """The finished checkpoints under ``out_dir``, oldest first; a link among them (or
    ``checkpoints`` itself a link) is refused, never followed."""
    root = Path(out_dir) / CHECKPOINTS_DIR
    check_no_link(root, out_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if is_step_name(path.name):
            check_no_link(path, out_dir)
            if path.is_dir() and STEP_NAME.match(path.name) and (path / MARKER).is_file():
                found.append(path)
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest finished checkpoint under ``out_dir``; partial or unmarked ones never count."""
    found = complete_checkpoints(out_dir)
    return found[-1] if found else None


def newest_verified(out_dir: str | Path, process_group: dist.ProcessGroup | None = None, *,
                    alone: bool = False, before: int | None = None) -> Path | None:
    """The newest finished checkpoint whose files match its manifest (None: there is none),
    of a step below ``before`` if given.

    Each damaged one is skipped with one warning naming the bad file and the step used
    instead; when every one is damaged, a ConfigError names the newest one's bad file.
    Collective unless ``alone`` (one process checks every file itself).
    """
    found = [path for path in complete_checkpoints(out_dir)
             if before is None or checkpoint_step(path) < before]
    damaged: list[tuple[Path, str]] = []
    for path in reversed(found):
        problem = checkpoint_problem(path, process_group, alone=alone)
        if problem is None:
            _warn_damaged(damaged, f"using {path.name} instead, the newest checkpoint that "
                                   "verifies", process_group, alone)
            return path
        damaged.append((path, problem))
    if not damaged:
        return None
    (newest, problem), older = damaged[0], len(damaged) - 1
    also = f" (nor can the {older} older one{'s' if older > 1 else ''})" if older else ""
    raise ConfigError(f"checkpoint {newest} cannot be used: {problem}{also}")


def _warn_damaged(damaged: list[tuple[Path, str]], instead: str,
                  group: dist.ProcessGroup | None, alone: bool) -> None:
    if not alone and _distributed() and dist.get_rank(group) != 0:
        return
    for path, problem in damaged:
        log.warning("checkpoint %s cannot be used: %s; %s", path, problem, instead)


def resume_checkpoint(out_dir: str | Path,
                      process_group: dist.ProcessGroup | None = None) -> Path:
    """The checkpoint ``--resume`` continues from: the newest that verifies (collective)."""
    found = newest_verified(out_dir, process_group)
    if found is None:
        raise ConfigError(
            f"nothing to resume: no complete checkpoint under {Path(out_dir) / CHECKPOINTS_DIR}"
        )
    return found


class _ShardWriter(HuggingFaceStorageWriter):
    """DCP's safetensors writer, one file per rank, remembering the files this rank wrote."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path), save_distributed=True)
        self.written: list[str] = []

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        self.written = sorted({result.storage_data.relative_path for result in future.wait()})
        return future


def save_checkpoint(out_dir: str | Path, step: int, state: Mapping[str, Any],
                    trainer_state: Mapping[str, Any],
                    process_group: dist.ProcessGroup | None = None, *,
                    rank_files: Callable[[Path], Sequence[Path]] | None = None) -> Path:
    """Save ``state`` (nested dicts of tensors, DTensors, plain values) as checkpoint ``step``.

    Every rank of ``process_group`` must call this. Ranks of the writing replica pass
    their part of the state, ranks of other data-parallel replicas pass ``{}``; every
    rank's RNG is saved either way. ``trainer_state`` (JSON-safe) is taken from the
    coordinator (group rank 0). Without an initialized process group it saves from
    this process alone. ``rank_files(partial)`` writes this rank's own files into the
    checkpoint being written (as the RNG's), which the manifest then lists.
    """
    trainer_json = json.dumps(dict(trainer_state), indent=2)  # fails on every rank alike
    tensors, values = split_state(state)
    final = checkpoint_path(out_dir, step)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    distributed = _distributed()
    coordinator = not distributed or dist.get_rank(process_group) == 0
    if coordinator:
        remove_tree(partial, out_dir, missing_ok=True)  # a save killed before this one
        real_dir(partial, out_dir)
    _barrier(process_group)
    writer = _ShardWriter(partial)
    _save_shards(_writable(tensors), writer, partial, process_group)
    with writing(partial, "write the checkpoint"):
        rng = save_rng(partial).relative_to(partial)
        own = [str(p.relative_to(partial)) for p in rank_files(partial)] if rank_files else []
    files, values = _gathered(digests(partial, [*writer.written, str(rng), *own]), values,
                              process_group)
    if coordinator:
        _commit(partial, final, step, {VALUES: values_text(values), TRAINER_STATE: trainer_json},
                files)
        log.info("saved checkpoint %s", final)
    _barrier(process_group)
    return final


def _save_shards(tensors: dict[str, Any], writer: _ShardWriter, partial: Path,
                 group: dist.ProcessGroup | None) -> None:
    """DCP's save; a rank's OSError (the disk full, read-only) becomes one line naming the
    checkpoint and the reason, raised on every rank alike."""
    try:
        with _single_process_is_intended():
            dcp.save(tensors, storage_writer=writer, process_group=group,
                     no_dist=not _distributed())
    except CheckpointException as err:
        failures = [failure[0] for failure in err.failures.values()]
        os_error = next((e for e in failures if isinstance(e, OSError)), None)
        if os_error is not None:
            raise output_error(partial, os_error, "write the checkpoint") from None
        raise ConfigError(f"cannot write the checkpoint {partial}: "
                          f"{_one_line(failures[0]) if failures else err}") from None


def _writable(state: Mapping[str, Any], seen: set[int] | None = None) -> dict[str, Any]:
    """The tensors as safetensors takes them: contiguous, none sharing memory with another
    (a tied embedding and head are one tensor under two names: the second is copied)."""
    from torch.distributed.tensor import DTensor

    seen = set() if seen is None else seen
    result: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, Mapping):
            result[key] = _writable(value, seen)
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        storage = local.untyped_storage().data_ptr()
        if not local.is_contiguous():
            value = value.contiguous()
        elif storage in seen and local.numel() > 0:
            value = value.clone()
        seen.add(storage)
        result[key] = value
    return result


def _gathered(files: dict[str, Any], values: dict[str, Any],
              group: dist.ProcessGroup | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every rank's file digests and plain values, merged (after every rank has written)."""
    if not _distributed():
        return files, values
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (files, values), group=group)
    merged_files: dict[str, Any] = {}
    merged_values: dict[str, Any] = {}
    for rank_files, rank_values in parts:
        merged_files.update(rank_files)
        merged_values.update(rank_values)
    return merged_files, merged_values


def _commit(partial: Path, final: Path, step: int, texts: Mapping[str, str],
            files: dict[str, Any]) -> None:
    """Write the JSON files, the manifest and the marker, then give the directory its name."""
    for name, text in texts.items():
        write_text(partial / name, text + "\n", sync=True)
        files[name] = file_digest(partial / name)
    write_text(partial / MANIFEST, manifest_text(files) + "\n", sync=True)
    world_size = dist.get_world_size() if _distributed() else 1
    marker = {"step": step, "world_size": world_size,
              "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    write_text(partial / MARKER, json.dumps(marker) + "\n", sync=True)
    root = final.parents[1]
    check_no_link(final, root)
    with writing(final, "finish the checkpoint"):
        if final.exists():
            stale = final.with_name(final.name + ".old")
            remove_tree(stale, root, missing_ok=True)
            final.rename(stale)
            partial.rename(final)
            remove_tree(stale, root)
        else:
            partial.rename(final)
        sync_dir(final.parent)


def load_checkpoint(path: str | Path, state: dict[str, Any],
                    process_group: dist.ProcessGroup | None = None, *,
                    verify: bool = True) -> dict[str, Any]:
    """Load checkpoint ``path`` into ``state`` in place; return its trainer state.

    ``state`` holds the keys (and, for DTensors, the shards) this rank needs, already
    allocated; they may be any subset of the saved keys, laid out under any plan.
    Every file is first checked against the manifest (``verify=False``: the caller
    just did, as :func:`resume_checkpoint` does). A damaged file, a key missing from
    the checkpoint or a shape that differs is a ConfigError raised on every rank alike;
    a plain value missing or of another type, an optimizer setting no optimizer steps with or
    a loaded tensor that is not finite, an :class:`UnusableCheckpoint`.
    """
    path = Path(path)
    if not (path / MARKER).is_file():
        raise ConfigError(f"{path}: not a complete checkpoint (no {MARKER} marker)")
    if verify and (problem := checkpoint_problem(path, process_group)):
        raise ConfigError(f"checkpoint {path} cannot be used: {problem}")
    reader = HuggingFaceStorageReader(str(path))
    saved_values, metadata, problem = _saved(path, reader)
    absent = _absent_masters(state, metadata) if metadata is not None else []
    tensors, _ = split_state(_without_masters(state, absent))
    if problem is None and metadata is not None:
        problem = _state_problem(tensors, metadata)
    problem = first_problem_on_any_rank(problem, process_group)
    if problem:
        raise ConfigError(f"checkpoint {path} does not fit this model: {problem}")
    values = values_problem(state, saved_values) or settings_problem(saved_values)
    if values := first_problem_on_any_rank(values, process_group):
        raise UnusableCheckpoint(f"checkpoint {path} cannot be resumed: its {VALUES} {values}")
    _read(path, tensors, reader, process_group)
    if problem := first_problem_on_any_rank(non_finite(tensors), process_group):
        raise UnusableCheckpoint(f"checkpoint {path} cannot be resumed: {problem}")
    _masters_from_weights(state, absent)
    restore_values(state, saved_values)
    if not _distributed() or dist.get_rank(process_group) == 0:
        log.info("loaded checkpoint %s", path)
    return read_trainer_state(path)


def non_finite(state: Mapping[str, Any], prefix: str = "") -> str | None:
    """The first floating-point tensor of ``state`` (this rank's shard of a DTensor) that
    holds an inf or a NaN, named; None: every one is finite."""
    from torch.distributed.tensor import DTensor

    for key, value in _flat_tensors(state, prefix):
        local = value.to_local() if isinstance(value, DTensor) else value
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            return f"{key} holds inf or NaN"
    return None


def _absent_masters(state: Mapping[str, Any], metadata: Metadata) -> list[str]:
    """The optimizer's FP32 master copies (:data:`~potluck.runtime.grads.master_weights.MASTER`)
    this rank asks for that the checkpoint lacks: one written by a run without them (FP32
    weights, no offload). They are optional: each becomes its weight's loaded value."""
    optim = state.get("optim")
    if not isinstance(optim, Mapping):
        return []
    saved = metadata.state_dict_metadata
    return [key for key in optim if key.startswith("state.") and key.endswith(f".{MASTER}")
            and f"optim.{key}" not in saved]


def _without_masters(state: Mapping[str, Any], absent: Sequence[str]) -> Mapping[str, Any]:
    if not absent:
        return state
    optim = {k: v for k, v in state["optim"].items() if k not in set(absent)}
    return {**state, "optim": optim}


def _masters_from_weights(state: Mapping[str, Any], absent: Sequence[str]) -> None:
    """Each absent master takes its (just loaded) weight's value."""
    for key in absent:
        weight = key[len("state."):-len(f".{MASTER}")]
        with torch.no_grad():
            state["optim"][key].copy_(state["model"][weight])


def _saved(path: Path, reader: HuggingFaceStorageReader
           ) -> tuple[dict[str, Any], Metadata | None, str | None]:
    """The saved plain values and the shards' metadata, or why they cannot be read."""
    try:
        saved_values = read_values(read_text(path / VALUES, VALUES))
        metadata = reader.read_metadata()
    except ConfigError as err:
        return {}, None, str(err)
    except Exception as err:  # noqa: BLE001 - a malformed shard header, whatever the library says
        return {}, None, f"its shards cannot be read ({_one_line(err)})"
    return saved_values, metadata, None


def _read(path: Path, tensors: dict[str, Any], reader: HuggingFaceStorageReader,
          group: dist.ProcessGroup | None) -> None:
    """DCP's load from the safetensors shards (every rank fails together if one does)."""
    try:
        with _single_process_is_intended():
            dcp.load(tensors, storage_reader=reader, process_group=group,
                     no_dist=not _distributed())
    except Exception as err:  # noqa: BLE001 - DCP wraps each rank's failure in its own type
        raise ConfigError(f"checkpoint {path} cannot be read: {_one_line(err)}") from err


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}"


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    try:
        state = json.loads(read_text(Path(path) / TRAINER_STATE, TRAINER_STATE))
    except (ConfigError, ValueError, RecursionError):
        state = None
    if not isinstance(state, dict):
        raise ConfigError(f"{Path(path) / TRAINER_STATE} is missing or not a JSON object")
    return state


def load_full_state_dict(path: str | Path, section: str = "model",
                         shapes: Mapping[str, tuple[int, ...]] | None = None
                         ) -> dict[str, torch.Tensor]:
    """Every tensor of one section (e.g. ``model``) as full, unsharded CPU tensors.

    Runs in this process alone (no collectives), whatever plan saved the checkpoint;
    every file is checked against the manifest first. ``shapes``: the shape of every
    tensor the section may hold (the model's), checked before anything is allocated, so
    that a shard header's offsets cannot ask for more memory than the model needs.
    """
    path = Path(path)
    if problem := checkpoint_problem(path, alone=True):
        raise ConfigError(f"checkpoint {path} cannot be used: {problem}")
    reader = HuggingFaceStorageReader(str(path))
    try:
        metadata = reader.read_metadata()
    except Exception as err:  # noqa: BLE001 - a malformed shard header
        raise ConfigError(f"checkpoint {path} cannot be read: {_one_line(err)}") from err
    prefix = f"{section}."
    items = {key.removeprefix(prefix): item for key, item in metadata.state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)}
    if shapes is not None and (problem := _shapes_problem(items, shapes)):
        raise ConfigError(f"checkpoint {path} does not fit the model: {problem}")
    tensors = {key: torch.empty(item.size, dtype=item.properties.dtype)
               for key, item in items.items()}
    if not tensors:
        raise ConfigError(f"checkpoint {path} has no {section!r} tensors")
    _read(path, {section: tensors}, reader, None)
    return tensors


def _shapes_problem(items: Mapping[str, TensorStorageMetadata],
                    shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """The first tensor of the shard headers that is not one of ``shapes`` or has another
    shape there (its offsets reaching past the model's shape, for one)."""
    for key, item in items.items():
        if key not in shapes:
            return f"it holds {key!r}, which the model has not"
        if tuple(item.size) != tuple(shapes[key]):
            return (f"its shards make {key!r} {tuple(item.size)} (offsets and shapes in their "
                    f"headers), the model needs {tuple(shapes[key])}")
    return None


def prune_checkpoints(out_dir: str | Path, keep_last: int, keep: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` finished checkpoints (``keep_last < 1`` keeps
    them all), never ``keep`` (the newest one known good); call on one rank only."""
    doomed = complete_checkpoints(out_dir)[:-keep_last] if keep_last > 0 else []
    doomed = [path for path in doomed if keep is None or path.resolve() != Path(keep).resolve()]
    for path in doomed:
        remove_tree(path, out_dir)
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


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Silence DCP's warning that it saves or loads in one process: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier(group: dist.ProcessGroup | None) -> None:
    if _distributed():
        dist.barrier(group=group)

