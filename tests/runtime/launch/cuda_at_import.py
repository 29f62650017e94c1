"""A module that touches CUDA when it is imported, as a GPU test's skip marker does.

On a CUDA build ``torch.cuda.is_available()`` initializes the driver and poisons fork:
a process forked afterwards fails at ``torch.cuda.set_device`` ("Cannot re-initialize
CUDA in forked subprocess"). A CPU build initializes nothing, so this module leaves the
same mark itself (``os.register_at_fork``, as torch's ``pthread_atfork`` handler does):
a rank forked from a process that imported it knows, and fails the same way.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

CUDA_SEEN = torch.cuda.is_available()
_forked_after_import = False


def _mark_forked_child() -> None:
    global _forked_after_import
    _forked_after_import = True


os.register_at_fork(after_in_child=_mark_forked_child)


def in_bad_fork() -> bool:
    """Whether this process was forked from one that had imported this module."""
    return _forked_after_import or torch.cuda._is_in_bad_fork()


def rank_sum() -> float:
    """What a GPU rank does first: refuse a poisoned fork, then join and all-reduce."""
    if in_bad_fork():
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess")
    dist.init_process_group("gloo")
    try:
        total = torch.ones(1)
        dist.all_reduce(total)
        return float(total.item())
    finally:
        dist.destroy_process_group()
