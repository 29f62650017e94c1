"""Each step's peak memory, as ``metrics.jsonl``'s ``peak_memory_gb`` reports it.

On a GPU the trainer restarts CUDA's peak counter when a step starts
(``torch.cuda.reset_peak_memory_stats`` of the rank's own device) and reads
``torch.cuda.max_memory_allocated`` when it ends, so a step's figure is what
that step needed (the weights, optimizer states and gradients it holds plus
its activations), not a start-up spike such as materializing the weights or
an earlier, larger step. A CPU process's peak resident set
(``getrusage``'s ``ru_maxrss``) cannot be restarted: on CPU the figure is the
process's peak so far. What the memory contract of issue 13 compares per rank is
in each step's ``memory`` rows (:func:`~potluck.runtime.loop.trainer.rank_memory_rows`):
a GPU's allocator peak, or a CPU rank's
:class:`~potluck.runtime.memory.ledger.MemoryLedger`, with host bytes beside it.
"""

from __future__ import annotations

import resource
import sys
from typing import Protocol

import torch


class PeakMemory(Protocol):
    def start(self) -> None: ...

    def peak_bytes(self) -> float: ...


class CudaPeakMemory:
    """The peak allocated memory of one CUDA device since :meth:`start`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> float:
        return float(torch.cuda.max_memory_allocated(self.device))


class ProcessPeakMemory:
    """The process's peak resident set so far (it cannot be restarted)."""

    def start(self) -> None:
        return None

    def peak_bytes(self) -> float:
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)


def peak_memory(device: torch.device) -> PeakMemory:
    """The meter of a rank computing on ``device``."""
    return CudaPeakMemory(device) if device.type == "cuda" else ProcessPeakMemory()
