"""Whether this machine's memory holds the ranks a local run starts, asked before any starts.

Every rank is a process of its own: Python, torch and transformers take about
:data:`RANK_BASE_BYTES` each before a tensor is made (344 MB of peak RSS measured after
importing ``potluck.runtime.worker``, torch 2.x on Linux). CPU ranks (``--emulate``, a
plan of ``cpu`` devices) also keep the model's weights, gradients and Adam states in host
memory: 16 bytes per parameter for each data-parallel replica. A run that needs more than
the memory available (``MemAvailable`` of ``/proc/meminfo``) would be killed by the
kernel's OOM killer without a word, so :func:`check_host_memory` refuses it in one line.
The estimate is a floor (activations and buffers come on top): it refuses only runs that
cannot fit.
"""

from __future__ import annotations

import os
from pathlib import Path

from potluck.errors import ConfigError
from potluck.model.counts import total_params
from potluck.plans import Plan

RANK_BASE_BYTES = 340e6
STATE_BYTES_PER_PARAM = 16  # FP32 weight, gradient and Adam's two moments
_MEMINFO = Path("/proc/meminfo")


def ranks_need_bytes(plan: Plan, *, host_states: bool) -> float:
    """Host memory the ranks of ``plan`` (the plan they compute) need at the least;
    ``host_states``: the model states live in host memory (CPU ranks)."""
    states = STATE_BYTES_PER_PARAM * total_params(plan.model) * plan.dp if host_states else 0.0
    return len(plan.devices) * RANK_BASE_BYTES + states


def available_bytes() -> float | None:
    """Memory available to new processes (``MemAvailable``; else the free pages); None when
    this system says neither."""
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (OSError, ValueError):
        return None


def check_host_memory(computed: Plan, *, host_states: bool,
                      available: float | None = None) -> None:
    """One ConfigError when the ranks of ``computed`` cannot fit in the memory available
    (``available``: that figure, else this machine's)."""
    available = available_bytes() if available is None else available
    needed = ranks_need_bytes(computed, host_states=host_states)
    if available is None or needed <= available:
        return
    ranks = len(computed.devices)
    states = needed - ranks * RANK_BASE_BYTES
    raise ConfigError(
        f"{ranks} ranks need at least {needed / 1e9:.1f} GB of host memory ({ranks} x "
        f"{RANK_BASE_BYTES / 1e9:.2f} GB per process, plus {states / 1e9:.1f} GB of model "
        f"states), but {available / 1e9:.1f} GB is available; run fewer ranks (a plan over "
        "fewer devices), a smaller model (--stand-in tiny when emulating), or free memory")
