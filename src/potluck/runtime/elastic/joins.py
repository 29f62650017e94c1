"""Devices that register with a running elastic run (``potluck join RUN --device ID``).

A device joins by leaving a file named after its id in the run's ``joined/`` folder;
the supervisor reads the folder while the ranks train and, when a plan with the new
devices is faster by its margin, has the run stop at its next checkpoint and continue
under that plan. Only ids of the run's own cluster (its ``plan.json``) may join: a file
in the folder is a name, never read as code or data.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from potluck.cluster.topology import Cluster
from potluck.errors import ConfigError
from potluck.plans import Plan

JOINED_DIR = "joined"


def register(run_dir: str | Path, plan: Plan, device_ids: Iterable[str]) -> list[str]:
    """Register ``device_ids`` (ids of ``plan``'s cluster) with the run; returns them."""
    known = {d.id for d in Cluster(plan.cluster).devices}
    ids = list(dict.fromkeys(device_ids))
    if not ids:
        raise ConfigError("name the devices that join with --device ID (ids look like "
                          f"{next(iter(sorted(known)))})")
    for device in ids:
        if device not in known:
            raise ConfigError(f"device {device!r} is not in the run's cluster "
                              f"{plan.cluster.name!r} (its ids: {', '.join(sorted(known))})")
    folder = Path(run_dir) / JOINED_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for device in ids:
        (folder / device).touch()
    return ids


def registered(run_dir: str | Path, plan: Plan) -> set[str]:
    """The device ids registered with the run that are in ``plan``'s cluster."""
    folder = Path(run_dir) / JOINED_DIR
    if not folder.is_dir():
        return set()
    known = {d.id for d in Cluster(plan.cluster).devices}
    return {p.name for p in folder.iterdir() if p.name in known}
