"""Example cluster files shipped with potluck (``potluck demo`` uses ``mixed.yaml``)."""

from importlib import resources
from pathlib import Path


def example_path(name: str) -> Path:
    """Path of a shipped example file, e.g. ``example_path("mixed.yaml")``."""
    return Path(str(resources.files("potluck.examples").joinpath(name)))
