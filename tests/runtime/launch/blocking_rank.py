"""A rank that blocks as an NCCL survivor does, or kills itself: ``python blocking_rank.py
PLAN VICTIM`` under torchrun (see test_watchdog's torchrun test)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from datetime import timedelta

import torch.distributed as dist

from potluck.plans import load_plan
from potluck.runtime.launch.session import start


def block_forever() -> None:
    """What a survivor does under NCCL: wait in C++ for a peer that never comes."""
    store = dist.distributed_c10d._get_default_store()
    store.wait(["never-set"], timedelta(hours=1))


def all_started(rank: int, world: int, timeout_s: float = 600.0) -> None:
    """Wait until every rank has returned from ``start``: until then another rank may still
    be connecting its process groups to this one, and a death would fail that connection
    (a named connect failure) instead of leaving the survivors blocked."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"test/started/{rank}", "1")
    store.wait([f"test/started/{other}" for other in range(world)], timedelta(seconds=timeout_s))


def main(plan_path: str, victim: int) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    session = start(load_plan(plan_path), timeout_s=3600)
    all_started(session.rank, dist.get_world_size())
    if session.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    block_forever()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
