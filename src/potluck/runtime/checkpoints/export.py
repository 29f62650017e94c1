"""Export trained weights as a Hugging Face model directory.

The result is ``config.json`` plus ``model.safetensors``, which
``transformers.AutoModelForCausalLM.from_pretrained(dir)`` loads as it would
any model, with the user's umask (safetensors alone would leave the weights 0600);
:func:`export_run` adds the tokenizer the run trained with, which
``AutoTokenizer.from_pretrained(dir)`` loads. The weights come either from per-rank
partial state dicts (a pipeline rank's stage, a replica's duplicate; merged, with
duplicates checked equal) or straight from a checkpoint directory, read in one process
whatever plan saved it, after every file was checked against the checkpoint's manifest.
The config is the spec's own Hugging Face config
(:func:`potluck.model.hf.hf_config_for`).

Before anything is written the weights are checked against the model the
config builds (on the meta device, so no memory is spent): every key present,
no stray ones, every shape right. Tied weights (GPT-2, tied Qwen2) are
written once, under the embedding's name, as ``save_pretrained`` does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from potluck.errors import ConfigError
from potluck.model.hf import hf_config_for
from potluck.model.spec import ModelSpec
from potluck.runtime.checkpoints.storage import load_full_state_dict
from potluck.safe_files import real_dir, writing

if TYPE_CHECKING:
    from potluck.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
TOKENIZER_DIR = "tokenizer"  # a run directory's copy of the tokenizer it trained with


def merge_state_dicts(parts: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One full state dict from partial ones; a key held twice must hold equal tensors."""
    from torch.distributed.tensor import DTensor

    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, tensor in part.items():
            if isinstance(tensor, DTensor):
                raise ValueError(f"{key} is a DTensor shard: call full_tensor() on all ranks first")
            tensor = tensor.detach().cpu()
            if key in merged and not torch.equal(merged[key], tensor):
                raise ValueError(f"{key} differs between the partial state dicts")
            merged[key] = tensor
    return merged


def export_hf(state_dict: Mapping[str, torch.Tensor], spec: ModelSpec,
              out_dir: str | Path) -> Path:
    """Write ``state_dict`` (full tensors, HF FQNs) as a Hugging Face directory."""
    config = hf_config_for(spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tensors = _checked_tensors(state_dict, model, spec.name)
    dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    config.architectures = [type(model).__name__]
    config.dtype = str(dtype).removeprefix("torch.")
    out = real_dir(out_dir)
    with writing(out, "export to"):
        config.save_pretrained(str(out))
        save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
        (out / WEIGHTS_FILE).chmod(_user_file_mode())  # safetensors writes its file 0600
    log.info("exported %s (%d tensors) to %s", spec.name, len(tensors), out)
    return out


def _user_file_mode() -> int:
    """The mode a new file gets from ``open()`` under this process's umask."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def export_checkpoint(checkpoint_dir: str | Path, spec: ModelSpec, out_dir: str | Path) -> Path:
    """Export the model weights of a potluck checkpoint; runs in one process."""
    return export_hf(checkpoint_weights(checkpoint_dir, spec), spec, out_dir)


def checkpoint_weights(checkpoint_dir: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint, every tensor its headers describe checked against
    the model before it is read."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config_for(spec))
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    shapes.update({name: tuple(buffer.shape) for name, buffer in model.named_buffers()})
    return load_full_state_dict(checkpoint_dir, "model", shapes)


def _checked_tensors(state_dict: Mapping[str, torch.Tensor], model: torch.nn.Module,
                     model_name: str) -> dict[str, torch.Tensor]:
    """The tensors to write, keyed and shaped as ``model`` expects; tied aliases dropped."""
    tied = _tied_aliases(model)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in tied}
    transient = {name for name, _ in model.named_buffers()} - set(expected)
    # a traced stage keeps the model's non-persistent buffers (rotary tables) among its state
    given = {k: v for k, v in state_dict.items() if k not in tied and k not in transient}
    missing = sorted(set(expected) - set(given))
    stray = sorted(set(given) - set(expected))
    if missing or stray:
        what = f"missing {missing[:3]}" if missing else f"unexpected {stray[:3]}"
        raise ConfigError(f"weights do not fit model {model_name!r}: {what}")
    for key, tensor in given.items():
        if tuple(tensor.shape) != expected[key]:
            raise ConfigError(
                f"weights do not fit model {model_name!r}: {key} is {tuple(tensor.shape)}, "
                f"the model needs {expected[key]}"
            )
    for alias, source in tied.items():
        if alias in state_dict and not torch.equal(state_dict[alias].cpu(), given[source].cpu()):
            log.warning("%s differs from the tied %s; exporting %s", alias, source, source)
    return {key: tensor.detach().cpu().contiguous() for key, tensor in given.items()}


def _tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Parameter names that are another parameter (``lm_head.weight`` -> the embedding)."""
    first_name: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            aliases[name] = first_name[id(param)]
        first_name.setdefault(id(param), name)
    return aliases


@dataclass(frozen=True)
class Exported:
    """What :func:`export_run` wrote: the Hugging Face directory and where it came from."""

    out_dir: Path
    checkpoint: Path
    step: int
    tokenizer: bool = True  # whether the run's tokenizer was written beside the weights


def export_run(run_dir: str | Path, out_dir: str | Path) -> Exported:
    """Export the newest checkpoint of a ``potluck train --out`` directory that verifies to a
    Hugging Face directory; the model is the one the run computed (a stand-in, when emulated).

    A damaged newer checkpoint is skipped with a warning that names the bad file, and so is
    one whose weights hold inf or NaN; the result says which step was exported.
    """
    from potluck.runtime.checkpoints.storage import CHECKPOINTS_DIR, checkpoint_step, newest_verified

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory to write the Hugging Face "
                          "model into")
    _check_outside_run(Path(run_dir), out)
    checkpoint = newest_verified(run_dir, alone=True)
    if checkpoint is None:
        raise ConfigError(
            f"nothing to export: no complete checkpoint under {Path(run_dir) / CHECKPOINTS_DIR}; "
            "potluck train --out DIR saves one at the end of a run (and every N steps with "
            "--checkpoint-every N)"
        )
    checkpoint, model, weights = _newest_finite(Path(run_dir), checkpoint)
    tokenizer = _run_tokenizer(Path(run_dir), model)  # a bad one is told before writing
    path = export_hf(weights, model, out)
    if tokenizer is not None:
        tokenizer.save(path)
    return Exported(out_dir=path, checkpoint=checkpoint, step=checkpoint_step(checkpoint),
                    tokenizer=tokenizer is not None)


def _run_tokenizer(run_dir: Path, model: ModelSpec) -> Tokenizer | None:
    """The tokenizer the run trained with: the one it kept in ``tokenizer/`` (read as any
    ``--tokenizer`` directory is; saving it writes tokenizer files only), or, for a run
    without one (random tokens, or a run of a potluck before it kept it), the byte
    tokenizer when the model's vocabulary is the byte one; else None, with a warning."""
    from potluck.data.tokenizer import ByteTokenizer, load_tokenizer
    from potluck.model import byte_vocab

    kept = run_dir / TOKENIZER_DIR
    if kept.is_dir():
        return load_tokenizer(kept)
    if model.vocab_size == byte_vocab.VOCAB_SIZE:
        return ByteTokenizer()
    log.warning("%s keeps no tokenizer (a run on random tokens, or one from before potluck "
                "kept it): the export has the weights only; save the run's tokenizer beside "
                "them with save_pretrained", run_dir)
    return None


def _newest_finite(run_dir: Path, checkpoint: Path
                   ) -> tuple[Path, ModelSpec, dict[str, torch.Tensor]]:
    """``checkpoint``, or the newest older one that verifies, whose weights are finite: the
    checkpoint, its model and its weights; one line when none is."""
    from potluck.runtime.checkpoints.storage import checkpoint_step, newest_verified, non_finite

    first: str | None = None
    while True:
        spec = _saved_model(checkpoint, run_dir)
        weights = checkpoint_weights(checkpoint, spec)
        if (problem := non_finite(weights)) is None:
            return checkpoint, spec, weights
        first = first or f"checkpoint {checkpoint} cannot be exported: {problem}"
        older = newest_verified(run_dir, alone=True, before=checkpoint_step(checkpoint))
        if older is None:
            raise ConfigError(f"{first}; no older checkpoint has finite weights")
        log.warning("checkpoint %s cannot be exported: %s; trying %s", checkpoint, problem, older)
        checkpoint = older


def _check_outside_run(run_dir: Path, out: Path) -> None:
    """``--out`` is neither the run directory nor inside its checkpoints."""
    from potluck.runtime.checkpoints.storage import CHECKPOINTS_DIR

    run, target = run_dir.resolve(), out.resolve()
    if target == run or target.is_relative_to(run / CHECKPOINTS_DIR):
        raise ConfigError(f"--out {out} is the run directory {run_dir} (or inside its "
                          f"checkpoints); export to a directory of its own, such as "
                          f"--out {run_dir / 'hf'}")


def _saved_model(checkpoint: Path, run_dir: Path) -> ModelSpec:
    """The model the run computed: from the checkpoint's trainer state, else the run's plan."""
    from pydantic import ValidationError

    from potluck.model.spec import model_from_dict
    from potluck.plans import load_plan
    from potluck.runtime.checkpoints.storage import TRAINER_STATE, read_trainer_state

    saved = read_trainer_state(checkpoint)
    if "model" not in saved:
        return load_plan(run_dir / "plan.json").model
    try:
        return model_from_dict(saved["model"])
    except ValidationError:
        raise ConfigError(f"{checkpoint / TRAINER_STATE}: its model is not a model potluck "
                          "knows how to build") from None
