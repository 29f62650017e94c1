"""Start training from a pretrained Hugging Face model directory (``potluck train --init-from``).

The directory holds ``model.safetensors`` or a sharded one (``model.safetensors.index.json``
naming a file per tensor), as ``save_pretrained`` and ``potluck export`` write them. The
names are the model's own parameter names (the export's, read back): the runtime trains
an unmodified Hugging Face model, so no renaming is needed, except that a checkpoint of
the bare base model (GPT-2 on the Hub: ``h.0.attn...``) is read under the causal LM's
``base_model_prefix`` (``transformer.h.0.attn...``), as ``from_pretrained`` does, and
routed experts saved one tensor per expert are read as the model's fused expert tensors
(:mod:`~potluck.runtime.checkpoints.expert_files`).

:meth:`PretrainedWeights.check` compares the files' headers (nothing is read) with the
model built on the meta device: every parameter present with its shape and a
floating-point dtype (16-bit values are upcast to the parameter's dtype), tied aliases
(``lm_head.weight`` of a tied model) optional, any other tensor named as unexpected
unless the model's own ``_keys_to_ignore_on_load_unexpected`` lists it. Each rank then
reads only what it holds (:meth:`PretrainedWeights.local_value`): the parameters of its
pipeline stages, and of a tensor-parallel or expert-parallel parameter only its rows or
columns, read as contiguous runs through ``safe_open(...).get_slice`` (GPT-2's fused
QKV shard is three runs), and of split experts only its own experts' tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from potluck.errors import ConfigError
from potluck.runtime.checkpoints.expert_files import (
    Conversion,
    PerExpert,
    per_expert,
    renamed,
    renamings_and_conversions,
)
from potluck.runtime.checkpoints.weight_files import INDEX_FILE, header, weight_files
from potluck.runtime.shards import ShardIndex, shard_index

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
Source = str | PerExpert  # a tensor of the files, or a fused expert tensor's per-expert ones


class PretrainedWeights:
    """The safetensors weights of a model directory, read by parameter name (see the module
    docstring). Files are opened on first use and closed by :meth:`close`."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.files = weight_files(directory)
        self.sources: dict[str, Source] = {}  # a parameter's name -> where its values are
        self._open: dict[Path, Any] = {}

    def check(self, model: nn.Module, model_name: str) -> None:
        """One ConfigError line unless the files hold exactly ``model``'s parameters (see
        the module docstring); afterwards :meth:`local_value` reads by parameter name."""
        headers = self._headers()
        prefix = f"{getattr(model, 'base_model_prefix', '')}."
        tied, expected = _parameters(model)
        model_type = str(getattr(getattr(model, "config", None), "model_type", ""))
        renames, conversions = renamings_and_conversions(model_type)
        present = renamed(list(headers), renames)
        sources = {name: _source(name, shape, prefix, present, conversions)
                   for name, shape in expected.items()}
        missing = [name for name, found in sources.items() if found is None]
        if missing:
            raise ConfigError(f"--init-from {self.directory}: weights do not fit {model_name!r}: "
                              f"missing {_some(missing)}")
        for name, found in sources.items():
            _check_source(self.directory, model_name, name, found, headers, expected[name])
        used = {file for found in sources.values() for file in _files_of(found)}
        used |= {present[name] for name in _optional(model, prefix, tied, present)}
        unexpected = [name for name in headers if name not in used]
        if unexpected:
            raise ConfigError(f"--init-from {self.directory}: weights do not fit {model_name!r}: "
                              f"unexpected {_some(unexpected)}; give the directory of this "
                              "model (its config.json describes another)")
        self.sources = {**sources, **{alias: sources[source] for alias, source in tied.items()}}

    def local_value(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """This rank's part of parameter ``name`` (its TP or expert shard, when ``param`` is
        a DTensor), read from the files in ``param``'s dtype, on the host."""
        if name not in self.sources:
            raise KeyError(f"{name}: check() the weights against the model first")
        found = self.sources[name]
        index = shard_index(param)
        if isinstance(found, PerExpert):
            value = self._experts(found, index)
        elif index.dim is None:
            value = self._file(self.files[found]).get_slice(found)[:]
        else:
            view = self._file(self.files[found]).get_slice(found)
            value = torch.cat([view[(slice(None),) * index.dim + (slice(start, end),)]
                               for start, end in _runs(index.positions)], dim=index.dim)
        return value.to(param.dtype).reshape(index.local_shape)

    def _experts(self, found: PerExpert, index: ShardIndex) -> torch.Tensor:
        """A fused expert tensor's local part: only the experts held, when split by expert."""
        def tensor(name: str) -> torch.Tensor:
            return self._file(self.files[name]).get_tensor(name)

        if index.dim == 0:
            return found.read(tensor, index.positions.tolist())
        value = found.read(tensor, range(len(found.parts)))
        return value if index.dim is None else value.index_select(index.dim, index.positions)

    def close(self) -> None:
        self._open.clear()

    def _file(self, path: Path) -> Any:
        from safetensors import safe_open

        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt", device="cpu")
        return self._open[path]

    def _headers(self) -> dict[str, dict[str, Any]]:
        headers: dict[str, dict[str, Any]] = {}
        for path in sorted(set(self.files.values())):
            headers.update({name: info for name, info in header(path).items()
                            if self.files.get(name) == path})
        absent = sorted(set(self.files) - set(headers))
        if absent:
            raise ConfigError(f"{self.directory / INDEX_FILE}: {_some(absent)} not in the file "
                              "the index names")
        return headers


def _parameters(model: nn.Module) -> tuple[dict[str, str], dict[str, torch.Size]]:
    """``model``'s tied aliases (name -> the name it shares) and its other parameters' shapes."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    shapes: dict[str, torch.Size] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
            shapes[name] = param.shape
    return tied, shapes


def _source(name: str, shape: torch.Size, prefix: str, present: Mapping[str, str],
            conversions: Sequence[Conversion]) -> Source | None:
    """Where parameter ``name``'s values are in the files (``present``: each tensor's name
    as the model calls it -> its file name): under its own name, without the base model's
    prefix, or one tensor per expert."""
    for candidate in (name, name.removeprefix(prefix)):
        if candidate in present:
            return present[candidate]
    return per_expert(name, shape[0], conversions, present) if len(shape) > 1 else None


def _files_of(found: Source | None) -> list[str]:
    if isinstance(found, PerExpert):
        return [file for part in found.parts for file in part]
    return [found] if found is not None else []


def _optional(model: nn.Module, prefix: str, tied: Mapping[str, str],
              present: Mapping[str, str]) -> set[str]:
    """Tensors the files may hold beyond the parameters (as the model calls them): tied
    aliases, buffers, and what the model's class says to ignore."""
    names = set(tied) | {name for name, _ in model.named_buffers()}
    names |= {name.removeprefix(prefix) for name in names}
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    ignored = {name for name in present if any(re.search(p, name) for p in patterns)}
    return (names & set(present)) | ignored


def _check_source(directory: Path, model_name: str, name: str, found: Source,
                  headers: Mapping[str, Mapping[str, Any]], shape: torch.Size) -> None:
    files = _files_of(found)
    if isinstance(found, PerExpert):
        given = found.shape_of({file: headers[file]["shape"] for file in files})
        where = f"{name} (from {files[0]} and the other experts)"
    else:
        given, where = tuple(headers[found]["shape"]), name
    if given is None or tuple(given) != tuple(shape):
        shown = "experts of different shapes" if given is None else str(tuple(given))
        raise ConfigError(f"--init-from {directory}: weights do not fit {model_name!r}: {where} "
                          f"is {shown}, the model needs {tuple(shape)}")
    for file in files:
        if headers[file]["dtype"] not in FLOAT_DTYPES:
            raise ConfigError(f"--init-from {directory}: {file} holds {headers[file]['dtype']} "
                              f"values; a parameter needs floating-point ones "
                              f"({', '.join(FLOAT_DTYPES)})")


def _some(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _runs(positions: torch.Tensor) -> Iterator[tuple[int, int]]:
    """``positions`` as consecutive ``[start, end)`` runs, in their order."""
    values = positions.tolist()
    start = previous = values[0]
    for value in values[1:]:
        if value != previous + 1:
            yield start, previous + 1
            start = value
        previous = value
    yield start, previous + 1


def checked_weights(directory: str | Path, model: nn.Module, model_name: str
                    ) -> PretrainedWeights:
    """The weights of ``directory``, checked against ``model`` (one ConfigError line)."""
    weights = PretrainedWeights(directory)
    weights.check(model, model_name)
    return weights
