"""A rank's own file in a checkpoint: ``FOLDER/rank_00003.safetensors``.

Some state is each rank's and never resharded (its random generators, an island's weights
between outer steps): each rank writes it into the checkpoint being saved, beside the shared
shards, and the manifest then lists it. Tensors and JSON-able metadata only, no pickles.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file


def rank_file(checkpoint: Path, folder: str, rank: int) -> Path:
    """Where rank ``rank`` keeps its own ``folder`` state in ``checkpoint``."""
    return checkpoint / folder / f"rank_{rank:05d}.safetensors"


def save_rank_file(checkpoint: Path, folder: str, rank: int, tensors: Mapping[str, torch.Tensor],
                   metadata: Mapping[str, str]) -> Path:
    """Write rank ``rank``'s ``tensors`` and ``metadata`` into ``checkpoint`` (being written,
    so made by this run); returns the file."""
    path = rank_file(checkpoint, folder, rank)
    path.parent.mkdir(exist_ok=True)
    save_file(dict(tensors), str(path), metadata=dict(metadata))
    return path
