"""The safetensors files of a Hugging Face model directory, found and read without torch.

``model.safetensors``, or the shards that ``model.safetensors.index.json`` names, as
``save_pretrained`` and ``potluck export`` write them. :func:`weight_files` says which file
holds each tensor and :func:`header` each tensor's dtype and shape, reading only the
headers (the pre-launch checks run before torch is imported); a bad directory, index or
file is one ConfigError line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from potluck.errors import ConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(directory: str | Path) -> dict[str, Path]:
    """Each tensor name of ``directory``'s safetensors weights, with the file that holds it."""
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError(f"--init-from {root}: not a directory; give a Hugging Face model "
                          "directory (config.json and model.safetensors)")
    if (root / INDEX_FILE).is_file():
        return _indexed_files(root)
    if (root / SINGLE_FILE).is_file():
        return {name: root / SINGLE_FILE for name in header(root / SINGLE_FILE)}
    raise ConfigError(f"--init-from {root}: holds no {SINGLE_FILE} or {INDEX_FILE}; potluck "
                      "reads safetensors weights (save the model with save_pretrained)")


def has_weights(directory: str | Path) -> bool:
    """Whether ``directory`` holds safetensors weights potluck can start from."""
    root = Path(directory)
    return (root / SINGLE_FILE).is_file() or (root / INDEX_FILE).is_file()


def _indexed_files(root: Path) -> dict[str, Path]:
    index = root / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {str(name): root / str(file) for name, file in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(f"{index}: not a safetensors index ({type(err).__name__}); it must "
                          "hold a weight_map of tensor name to file") from None
    for file in sorted(set(files.values())):
        if file.resolve().parent != root.resolve() or not file.is_file():
            raise ConfigError(f"{index}: names {file.name}, which is not a file of {root}")
    return files


def header(path: Path) -> dict[str, dict[str, Any]]:
    """The safetensors header of ``path``: each tensor's dtype and shape (no data read)."""
    try:
        with path.open("rb") as file:
            size = int.from_bytes(file.read(8), "little")
            if size <= 0 or size > path.stat().st_size - 8:
                raise ValueError("bad header length")
            header = json.loads(file.read(size))
        header.pop("__metadata__", None)
        return {str(name): {"dtype": str(info["dtype"]), "shape": list(info["shape"])}
                for name, info in header.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(f"{path}: not a safetensors file ({err})") from None
