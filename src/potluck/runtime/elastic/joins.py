"""Devices offered to or taken from a running elastic run (``potluck join``/``potluck leave``).

A device joins by a file named after its id in the run's ``joined/`` folder, and is
taken away (a lab mate needs the card back) by one in ``leaving/``; each call clears the
device's mark in the other folder. The supervisor reads both folders while the ranks
train: a plan with joined devices is taken when it is faster by the margin, a plan
without leaving devices always (they must go), at the ranks' next checkpoint. Only ids of
the run's own cluster (its ``plan.json``) may be named: a file in the folders is a name,
never read as code or data.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from potluck.cluster.topology import Cluster
from potluck.errors import ConfigError
from potluck.plans import Plan
from potluck.safe_files import real_dir, write_text, writing

JOINED_DIR = "joined"
LEAVING_DIR = "leaving"


def register(run_dir: str | Path, plan: Plan, device_ids: Iterable[str]) -> list[str]:
    """Offer ``device_ids`` (ids of ``plan``'s cluster) to the run; returns them."""
    return _mark(run_dir, plan, device_ids, JOINED_DIR, LEAVING_DIR)


def release(run_dir: str | Path, plan: Plan, device_ids: Iterable[str]) -> list[str]:
    """Take ``device_ids`` away from the run at its next checkpoint; returns them."""
    return _mark(run_dir, plan, device_ids, LEAVING_DIR, JOINED_DIR)


def _mark(run_dir: str | Path, plan: Plan, device_ids: Iterable[str], folder_name: str,
          cleared_name: str) -> list[str]:
    known = {d.id for d in Cluster(plan.cluster).devices}
    ids = list(dict.fromkeys(device_ids))
    if not ids:
        raise ConfigError("name the devices with --device ID (ids look like "
                          f"{next(iter(sorted(known)))})")
    for device in ids:
        if device not in known:
            raise ConfigError(f"device {device!r} is not in the run's cluster "
                              f"{plan.cluster.name!r} (its ids: {', '.join(sorted(known))})")
    folder = real_dir(Path(run_dir) / folder_name, run_dir)
    for device in ids:
        cleared = Path(run_dir) / cleared_name / device
        with writing(cleared, "delete"):
            cleared.unlink(missing_ok=True)  # a link itself, never what it points at
        write_text(folder / device, "", root=run_dir)
    return ids


def registered(run_dir: str | Path, plan: Plan) -> set[str]:
    """The device ids offered to the run that are in ``plan``'s cluster."""
    return _marked(run_dir, plan, JOINED_DIR)


def leaving(run_dir: str | Path, plan: Plan) -> set[str]:
    """The device ids taken from the run that are in ``plan``'s cluster."""
    return _marked(run_dir, plan, LEAVING_DIR)


def _marked(run_dir: str | Path, plan: Plan, folder_name: str) -> set[str]:
    folder = Path(run_dir) / folder_name
    if not folder.is_dir():
        return set()
    known = {d.id for d in Cluster(plan.cluster).devices}
    return {p.name for p in folder.iterdir() if p.name in known}
