"""Each rank's island state in a checkpoint of a plan whose islands synchronize rarely.

Between outer steps the islands' weights differ, and so do their inner optimizers' states
at any step (DiLoCo keeps each island's inner optimizer its own); the checkpoint's shared
tensors hold one copy per parameter (the first replica's). So each rank also writes
``islands/rank_00003.safetensors``: its local weights and inner optimizer states (local
shards, by the shared tensors' keys) and its exchange's state across islands
(:mod:`potluck.runtime.grads.islands`: DiLoCo's snapshots and outer momentum, bounded
staleness' bases), with the counters as JSON in the file's metadata. A resume under the
same plan loads them over the shared tensors, so it continues the uninterrupted run. A
checkpoint saved without islands, or under another split, has no such file for some
rank: resuming it under islands is refused (not yet supported).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from potluck.errors import ConfigError
from potluck.runtime.checkpoints.storage import apply_training_state, training_state
from potluck.runtime.grads.buckets import local
from potluck.runtime.loop.trainer import Trainer

ISLANDS_DIR = "islands"
_OWN = "own."  # this rank's weights and inner optimizer states, by training_state's keys
_SYNC = "sync."  # the exchange's tensors


def island_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / ISLANDS_DIR / f"rank_{rank:05d}.safetensors"


def save_island_state(trainer: Trainer, checkpoint: Path) -> list[Path]:
    """Write this rank's island state into ``checkpoint``; the files written (none without
    islands that synchronize rarely)."""
    if not trainer.model.layout.plan.islands.split:
        return []
    state = trainer.islands.state_dict()
    tensors = {f"{_SYNC}{key}": value.contiguous().cpu()
               for key, value in state["tensors"].items()}
    own = training_state([trainer.model.module], [trainer.optimizer])
    for section, values in own.items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{_OWN}{section}.{key}"] = local(value).detach().contiguous().cpu()
    path = island_file(checkpoint, trainer.model.layout.rank)
    path.parent.mkdir(exist_ok=True)
    save_file(tensors, str(path), metadata={"counters": json.dumps(state["counters"])})
    return [path]


def load_island_state(trainer: Trainer, checkpoint: Path) -> None:
    """Load this rank's island state from ``checkpoint`` over what the shared tensors gave
    (nothing without islands that synchronize rarely)."""
    if not trainer.model.layout.plan.islands.split:
        return
    rank = trainer.model.layout.rank
    path = island_file(checkpoint, rank)
    if not path.is_file():
        raise ConfigError(
            f"checkpoint {checkpoint} holds no island state for rank {rank}: it was saved "
            "without islands or under another split, and resuming under another island split "
            "is not supported yet; train again without --resume")
    try:
        with safe_open(str(path), framework="pt") as file:
            counters = json.loads((file.metadata() or {})["counters"])
            saved = {key: file.get_tensor(key) for key in file.keys()}
    except (SafetensorError, KeyError, ValueError) as err:
        raise ConfigError(f"{path}: not an island state potluck wrote ({err})") from None
    _load_own(trainer, saved)
    sync = {key[len(_SYNC):]: value for key, value in saved.items() if key.startswith(_SYNC)}
    trainer.islands.load_state_dict({"tensors": sync, "counters": counters})


def _load_own(trainer: Trainer, saved: dict[str, torch.Tensor]) -> None:
    """This rank's weights and inner optimizer states into the trainer."""
    state = training_state([trainer.model.module], [trainer.optimizer])
    with torch.no_grad():
        for section, values in state.items():
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    local(value).copy_(saved[f"{_OWN}{section}.{key}"])
    apply_training_state([trainer.model.module], [trainer.optimizer], state)
