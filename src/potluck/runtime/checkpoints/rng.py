"""Each rank's random number generators in a checkpoint, without pickles.

``rng/rank_00003.safetensors`` holds rank 3's torch CPU generator state (a
uint8 tensor) and, where this rank computes on a GPU, the generator state of
its own device only (``cuda``: the current device, which the session set with
``torch.cuda.set_device``), with python's ``random`` state as JSON in the
file's metadata. A rank never reads or restores another device's generator,
so a checkpoint saved by ranks on 8 GPUs resumes where fewer are visible
(``CUDA_VISIBLE_DEVICES``, another machine), a CPU run's checkpoint resumes on
GPUs (no ``cuda`` entry: the device keeps its seeded generator) and a GPU run's
on CPU (the entry is left unused). Dropout masks after a resume on the same
devices are then those of the uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from potluck.errors import ConfigError
from potluck.runtime.checkpoints.rank_files import rank_file, save_rank_file

log = logging.getLogger(__name__)

RNG_DIR = "rng"


def rng_file(checkpoint: Path, rank: int) -> Path:
    return rank_file(checkpoint, RNG_DIR, rank)


def save_rng(checkpoint: Path) -> Path:
    """Write this process's RNG states into ``checkpoint``; returns the file written."""
    tensors = {"torch": torch.get_rng_state()}
    device = own_cuda_device()
    if device is not None:
        tensors["cuda"] = torch.cuda.get_rng_state(device)
    return save_rank_file(checkpoint, RNG_DIR, _global_rank(), tensors,
                          {"python": json.dumps(random.getstate())})


def load_rng_state(checkpoint: str | Path) -> bool:
    """Restore this process's RNG from ``checkpoint``; False if it saved none for this rank."""
    path = rng_file(Path(checkpoint), _global_rank())
    if not path.is_file():
        log.warning("checkpoint %s has no RNG state for rank %d; keeping the seeded RNG",
                    checkpoint, _global_rank())
        return False
    try:
        with safe_open(str(path), framework="pt") as file:
            python = _python_state(json.loads((file.metadata() or {})["python"]))
            cpu = file.get_tensor("torch")
            cuda = file.get_tensor("cuda") if "cuda" in file.keys() else None
        random.setstate(python)
        torch.set_rng_state(cpu)
        _restore_cuda(cuda, path)
    except (SafetensorError, KeyError, ValueError, TypeError, RuntimeError) as err:
        raise ConfigError(f"{path}: not an RNG state potluck wrote ({err})") from None
    return True


def own_cuda_device() -> int | None:
    """This rank's GPU (the current CUDA device) once it computes there; None on CPU."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def _restore_cuda(saved: torch.Tensor | None, path: Path) -> None:
    """The saved GPU generator onto this rank's own device; a side that has none keeps
    what it has (a CPU checkpoint on a GPU, a GPU checkpoint on CPU)."""
    device = own_cuda_device()
    if saved is not None and device is not None:
        torch.cuda.set_rng_state(saved, device)
    elif saved is None and device is not None:
        log.info("%s has no GPU generator state (saved on CPU); GPU %d keeps its seeded one",
                 path, device)


def _python_state(saved: list) -> tuple:
    """``random.getstate()``'s tuple back from its JSON lists."""
    version, internal, gauss = saved
    return version, tuple(internal), gauss


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
