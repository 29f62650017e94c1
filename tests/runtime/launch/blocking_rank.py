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


def main(plan_path: str, victim: int) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    session = start(load_plan(plan_path), timeout_s=3600)
    if session.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    block_forever()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
