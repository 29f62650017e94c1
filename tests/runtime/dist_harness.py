"""Run a function on N gloo ranks in spawned processes, with every wait bounded.

Used by the multi-process checkpoint tests. Each rank runs
``worker(rank, world_size, *args)`` after joining a gloo process group whose
rendezvous store this process hosts (as torchrun's agent does: the port is
bound before any rank starts, so two tests never race for it); a rank that
fails or a run that exceeds ``timeout_s`` fails the test instead of hanging it.
Workers must be importable top-level
functions (they are pickled by name). Processes come from a forkserver that
has imported torch and transformers once, so a run starts in well under a
second instead of paying the imports on every rank.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def _entry(worker: Callable[..., None], rank: int, world_size: int, port: int,
           args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=30))
    try:
        worker(rank, world_size, *args)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    dist.destroy_process_group()


PRELOAD = ["torch", "torch.distributed.checkpoint", "transformers"]


def _context() -> mp.context.BaseContext:
    """A forkserver that imports torch and transformers once for all runs of the session."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def run_ranks(worker: Callable[..., None], world_size: int, *args: Any,
              timeout_s: float = 90.0) -> None:
    """Run ``worker`` on ``world_size`` ranks; raise if any fails or time runs out."""
    import torch.distributed as dist

    context = _context()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    processes = [context.Process(target=_entry, args=(worker, rank, world_size, store.port, args))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(processes) if p.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5)
    if hung:
        raise TimeoutError(f"ranks {hung} still running after {timeout_s:.0f}s")
    failed = {rank: p.exitcode for rank, p in enumerate(processes) if p.exitcode != 0}
    if failed:
        raise RuntimeError(f"ranks failed with exit codes {failed} (tracebacks above)")
