"""Checksums of a checkpoint's files: written at save, checked before anything is read.

``manifest.json`` lists every file of a checkpoint directory (shards, the
non-tensor values, the trainer state, each rank's RNG) with its size in bytes
and its SHA-256. It is written by the coordinator after every rank has hashed
the files it wrote, and before the ``COMPLETE`` marker, so a complete
checkpoint always has one.

:func:`checkpoint_problem` checks a checkpoint against its manifest: every
listed file present with its size and hash, no file that is not listed (the
safetensors reader reads every ``*.safetensors`` file in the directory, so a
stray one would be read), and no ``.metadata`` file (the pickle of the old
DCP format, which potluck never unpickles). The hashing is split over the
ranks of a job and the result shared, so every rank sees the same answer and
raises or falls back together. The manifest guards against damage (a torn
copy, a flipped or overwritten byte); it is not a signature: whoever can
write a run directory can write a matching manifest, which is why nothing in
a checkpoint is ever loaded in a way that could run code.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from potluck.errors import ConfigError
from potluck.yamlio import read_text

MANIFEST = "manifest.json"
MARKER = "COMPLETE"  # written after the manifest; a manifest lists neither itself nor it
FORMAT_VERSION = 2  # 1: DCP's pickled .metadata (refused); 2: safetensors shards + JSON
OLD_METADATA = ".metadata"
_CHUNK_BYTES = 1 << 20


def file_digest(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex}`` of one file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK_BYTES):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def digests(directory: Path, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The digests of ``names`` (paths relative to ``directory``)."""
    return {name: file_digest(directory / name) for name in names}


def manifest_text(files: Mapping[str, Mapping[str, Any]]) -> str:
    return json.dumps({"format": FORMAT_VERSION, "files": dict(sorted(files.items()))}, indent=1)


def checkpoint_problem(path: Path, group: dist.ProcessGroup | None = None, *,
                       alone: bool = False) -> str | None:
    """Why checkpoint ``path`` cannot be trusted (None: every file matches its manifest).

    Collective when a process group is initialized: every rank hashes a share of the
    files and all return the same answer. ``alone``: this process hashes every file.
    """
    problem, listed = _manifest_problem(path)
    if problem is None:
        rank, world = (0, 1) if alone else _rank_and_world(group)
        problem = _first_mismatch(path, sorted(listed)[rank::world], listed)
    return problem if alone else first_problem_on_any_rank(problem, group)


def _manifest_problem(path: Path) -> tuple[str | None, dict[str, Any]]:
    """A problem with the manifest itself or with which files exist; else the listed files."""
    if (path / OLD_METADATA).exists():
        return (f"it has a DCP {OLD_METADATA} file, which is a pickle (the format of potluck "
                "before checkpoints were verified): loading it could run code, so potluck does "
                "not read it; train again with this version"), {}
    if not (path / MANIFEST).exists():
        return f"it has no {MANIFEST} (no checksums to verify its files with)", {}
    try:
        manifest = json.loads(read_text(path / MANIFEST, MANIFEST))
        listed = dict(manifest["files"])
        version = manifest["format"]
    except ConfigError as err:
        return str(err), {}
    except (ValueError, KeyError, TypeError, RecursionError):
        return f"its {MANIFEST} is not a potluck manifest (damaged?)", {}
    if version != FORMAT_VERSION:
        return f"its format is {version!r}; this potluck reads format {FORMAT_VERSION}", {}
    present = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}
    present -= {MANIFEST, MARKER}
    missing = sorted(set(listed) - present)
    stray = sorted(present - set(listed))
    if missing:
        return f"{missing[0]} is missing", {}
    if stray:
        return f"{stray[0]} is not one of the files it was saved with", {}
    return None, listed


def _first_mismatch(path: Path, names: Sequence[str], listed: Mapping[str, Any]) -> str | None:
    for name in names:
        expected = listed[name]
        found = file_digest(path / name)
        if not isinstance(expected, Mapping) or found["bytes"] != expected.get("bytes"):
            return f"{name} has {found['bytes']} bytes, {MANIFEST} says {_field(expected, 'bytes')}"
        if found["sha256"] != expected.get("sha256"):
            return f"{name} does not match its sha256 in {MANIFEST} (damaged or changed since saving)"
    return None


def _field(entry: Any, key: str) -> Any:
    return entry.get(key) if isinstance(entry, Mapping) else None


def _rank_and_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def first_problem_on_any_rank(problem: str | None, group: dist.ProcessGroup | None) -> str | None:
    """Share each rank's answer so that all ranks act alike instead of hanging."""
    if not (dist.is_available() and dist.is_initialized()):
        return problem
    problems: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    return next((p for p in problems if p), None)
