"""A process that saves checkpoint 1, then is SIGKILLed while saving checkpoint 2.

``python killed_save.py OUT_DIR WHERE`` with WHERE one of:
``writing`` (the shard file written, the manifest not yet), or ``marker`` (the
marker written, the directory not yet renamed). Used by
test_checkpoint_atomic.py; a kill is the one failure no ``finally`` can tidy.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from potluck.runtime.checkpoints import storage


def _kill_after(function):
    def wrapper(*args, **kwargs):
        result = function(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
        return result
    return wrapper


def _arm(where: str) -> None:
    if where == "writing":
        HuggingFaceStorageWriter.write_data = _kill_after(HuggingFaceStorageWriter.write_data)
    elif where == "marker":
        original = storage.write_text

        def write_then_die(path: Path, text: str, **options) -> Path:
            written = original(path, text, **options)
            if path.name == storage.MARKER:
                os.kill(os.getpid(), signal.SIGKILL)
            return written

        storage.write_text = write_then_die
    else:
        raise SystemExit(f"unknown kill point {where!r}")


def main(out_dir: str, where: str) -> None:
    state = {"model": {"w": torch.arange(1000.0)}}
    storage.save_checkpoint(out_dir, 1, state, {"step": 1})
    _arm(where)
    state["model"]["w"] += 1
    storage.save_checkpoint(out_dir, 2, state, {"step": 2})


if __name__ == "__main__":
    main(*sys.argv[1:])
