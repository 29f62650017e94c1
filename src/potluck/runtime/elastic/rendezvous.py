"""An elastic run across machines: torchrun's elastic agents restart the ranks, potluck's
ranks agree on the plan for the machines that are there.

``potluck train --elastic --print-commands`` prints torchrun commands that rendezvous
through torchrun's own c10d backend (``--rdzv-backend=c10d``, ``--nnodes=1:N``,
``--max-restarts``): when a rank dies the agents restart every rank, and when a machine
is gone (or comes back) the next rendezvous has the machines that are there. At every
start (the first too: fewer machines than the plan's may have met), :func:`elastic_start`
runs in every rank before it joins the job:

1. each rank writes the device it runs (its machine ``POTLUCK_NODE`` and ``LOCAL_RANK`` in
   the plan it was started with) to the agents' store, under this restart's prefix, and
   reads everyone's;
2. when the run's current plan (``DIR/plan.json``) has every device it needs, it stands;
   else rank 0 plans for the devices present
   (:func:`~potluck.runtime.elastic.pool.plan_for_devices`), appends the replan to
   ``replans.jsonl``, and passes the plan on through the store (as JSON, read back as any
   plan file from someone else is);
3. ranks whose device the plan leaves out stop at once (exit 0); the others join the job
   under new rank numbers and, after a restart, resume from the newest checkpoint that
   verifies (rank 0 checks that one exists and tells the others through the store; a
   drill's failure is injected in the first start only).

The run directory must be one every machine sees (a shared file system), as resuming
across machines already needs.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from potluck.errors import ConfigError, InfeasibleError
from potluck.plans import Plan, load_plan, plan_from_dict, plan_to_json, save_plan
from potluck.runtime.checkpoints.storage import newest_verified
from potluck.runtime.elastic.pool import plan_for_devices
from potluck.runtime.elastic.replans import append_replan
from potluck.runtime.elastic.supervisor import describe_replan, restart_step
from potluck.runtime.launch.session import agent_store, local_device_id
from potluck.runtime.options import TrainOptions

log = logging.getLogger(__name__)
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
STORE_TIMEOUT_S = 300.0
_PLAN_FILE = "plan.json"


@dataclass(frozen=True)
class ElasticStart:
    """What this rank runs after a restart: the plan and options, or nothing (sits out)."""

    plan: Plan | None
    options: TrainOptions


def under_torchrun() -> bool:
    """Whether torchrun's elastic agent started this rank."""
    return RESTART_ENV in os.environ


def restarted() -> bool:
    """Whether torchrun's agent started this rank again (after a failure or a change)."""
    return int(os.environ.get(RESTART_ENV, "0") or 0) > 0


def elastic_start(started_with: Plan, options: TrainOptions) -> ElasticStart:
    """This rank's plan after a torchrun restart (see the module docstring); sets ``RANK``,
    ``WORLD_SIZE`` and ``POTLUCK_DEVICE`` for joining the job under it."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = local_device_id(started_with, rank, int(os.environ.get("LOCAL_RANK", rank)))
    store = dist.PrefixStore(f"potluck/elastic/{os.environ.get(RESTART_ENV, '0')}",
                             agent_store(timedelta(seconds=STORE_TIMEOUT_S)))
    store.set(f"device/{rank}", device)
    devices = [store.get(f"device/{r}").decode() for r in range(world)]
    plan = _agreed_plan(store, rank, _current_plan(started_with, options), devices, options)
    again = restarted()
    resumed = replace(options, inject_failure=None if again else options.inject_failure,
                      resume=options.resume or (again and _checkpoint_to_resume(store, rank,
                                                                                options)))
    if device not in plan.devices:
        log.info("rank %d (%s): the plan after the restart leaves this device out", rank, device)
        return ElasticStart(None, resumed)
    members = [r for r in range(world) if devices[r] in plan.devices]
    os.environ.update(RANK=str(members.index(rank)), WORLD_SIZE=str(len(members)),
                      POTLUCK_DEVICE=device)
    return ElasticStart(plan, resumed)


def _checkpoint_to_resume(store: dist.Store, rank: int, options: TrainOptions) -> bool:
    """Whether the run directory holds a checkpoint that verifies: rank 0 reads it, once for
    every rank (a large checkpoint on a shared file system is not read by each), and all
    ranks resume or start alike."""
    if rank == 0:
        found = newest_verified(_run_dir(options), alone=True) is not None
        store.set("resume", "yes" if found else "no")
    return store.get("resume") == b"yes"


def _run_dir(options: TrainOptions) -> str:
    if not options.out_dir:
        raise ConfigError("--elastic restarts from the run's checkpoints: give --out DIR")
    return options.out_dir


def _current_plan(started_with: Plan, options: TrainOptions) -> Plan:
    """The run's plan: the one its directory holds (the last replan's), else the first."""
    path = Path(_run_dir(options)) / _PLAN_FILE
    return load_plan(path) if path.is_file() else started_with


def _agreed_plan(store: dist.Store, rank: int, current: Plan, devices: list[str],
                 options: TrainOptions) -> Plan:
    """The current plan if every device it needs is here; else rank 0's plan for those."""
    missing = tuple(d for d in current.devices if d not in devices)
    if not missing:
        return current
    if rank == 0:
        store.set("plan", _replanned(current, devices, missing, options))
    text = store.get("plan").decode()
    if text.startswith("error:"):
        raise InfeasibleError(text.removeprefix("error:"))
    try:
        data = json.loads(text)
    except ValueError:
        raise ConfigError("the restarted run's plan in the agents' store is not JSON") from None
    return plan_from_dict(data, "the restarted run's plan")


def _replanned(current: Plan, devices: list[str], missing: tuple[str, ...],
               options: TrainOptions) -> str:
    """Rank 0's part: the plan for ``devices`` as JSON (logged and kept in the run
    directory), or ``error:`` and the one line that says why there is none."""
    try:
        new = plan_for_devices(current, set(devices))
    except (InfeasibleError, ConfigError) as err:
        return (f"error:{', '.join(missing)} gone; no plan fits the {len(devices)} devices "
                f"left: {err}")
    record = describe_replan(current, new, options, "lost", restart_step(options), lost=missing,
                             cause="the machines that came back after a restart lack them")
    append_replan(_run_dir(options), record)
    save_plan(new, Path(_run_dir(options)) / _PLAN_FILE)
    return plan_to_json(new, indent=None)
