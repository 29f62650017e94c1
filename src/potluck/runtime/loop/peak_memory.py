"""Each step's peak memory, as ``metrics.jsonl``'s ``peak_memory_gb`` and ``memory`` rows
report it.

On a GPU the trainer restarts CUDA's peak counters when a step starts
(``torch.cuda.reset_peak_memory_stats`` of the rank's own device and of the peer its
stage swaps to) and reads them when it ends, so a step's figures are what that step
needed (the weights, optimizer states and gradients it holds plus its activations), not a
start-up spike such as materializing the weights or an earlier, larger step. Per device
(:class:`DevicePeaks`): the caching allocator's live tensors
(``torch.cuda.max_memory_allocated``, ``peak_memory_gb``); what it reserved from the
driver, its cache and fragmentation included (``max_memory_reserved``); and the device's
memory in use by everyone (``torch.cuda.mem_get_info``: total minus free, so the CUDA
contexts, NCCL's buffers and other processes too), at the step's end plus the reserve the
allocator had at its peak above what it holds then. A peer swap's stash lives on the peer
device: this process's context and reserved blocks there are read from the peer device's
figures (its allocator in this process; its memory in use, which the peer's own rank
reports too). A CPU process's peak resident set (``getrusage``'s ``ru_maxrss``) cannot be
restarted: on CPU ``peak_memory_gb`` is the process's peak so far, and device figures are
the rank's :class:`~potluck.runtime.memory.ledger.MemoryLedger` (in each step's
``memory`` rows: :func:`~potluck.runtime.loop.trainer.rank_memory_rows`).
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class DevicePeaks:
    """One GPU's peaks over a step, in bytes."""

    allocated_bytes: float  # this process's live tensors there (the caching allocator's)
    reserved_bytes: float  # what this process's allocator held there: cache, fragmentation
    used_bytes: float  # the device's memory in use by every process, contexts and NCCL


class PeakMemory(Protocol):
    def start(self) -> None: ...

    def peak_bytes(self) -> float: ...

    def device_peaks(self) -> DevicePeaks | None: ...

    def peer_peaks(self) -> dict[str, DevicePeaks]: ...


class CudaPeakMemory:
    """The peaks of one CUDA device, and of the peers it swaps to, since :meth:`start`."""

    def __init__(self, device: torch.device,
                 peers: Mapping[str, torch.device] | None = None) -> None:
        """``peers``: the devices this rank's stashes live on, by the plan's device id."""
        self.device = device
        self.peers = dict(peers or {})

    def start(self) -> None:
        for device in (self.device, *self.peers.values()):
            torch.cuda.reset_peak_memory_stats(device)

    def peak_bytes(self) -> float:
        return float(torch.cuda.max_memory_allocated(self.device))

    def device_peaks(self) -> DevicePeaks:
        return _peaks(self.device)

    def peer_peaks(self) -> dict[str, DevicePeaks]:
        return {name: _peaks(device) for name, device in self.peers.items()}


def _peaks(device: torch.device) -> DevicePeaks:
    """``device``'s peaks since its counters were reset (see the module docstring)."""
    reserved = float(torch.cuda.max_memory_reserved(device))
    free, total = torch.cuda.mem_get_info(device)
    used = total - free + reserved - torch.cuda.memory_reserved(device)
    return DevicePeaks(float(torch.cuda.max_memory_allocated(device)), reserved, float(used))


class ProcessPeakMemory:
    """The process's peak resident set so far (it cannot be restarted); no device figures."""

    def start(self) -> None:
        return None

    def peak_bytes(self) -> float:
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)

    def device_peaks(self) -> None:
        return None

    def peer_peaks(self) -> dict[str, DevicePeaks]:
        return {}


def peak_memory(device: torch.device,
                peers: Mapping[str, torch.device] | None = None) -> PeakMemory:
    """The meter of a rank computing on ``device`` (swapping to ``peers``, on GPUs)."""
    return CudaPeakMemory(device, peers) if device.type == "cuda" else ProcessPeakMemory()
