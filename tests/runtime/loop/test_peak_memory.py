"""``peak_memory_gb`` on a GPU is each step's own peak: CUDA's peak counters of the rank's
device are restarted when a step starts, so neither start-up (materializing the weights)
nor an earlier, larger step inflates a later step's figure. Beside it each rank's
``memory`` row reports its allocator's peak reserve and the device's memory in use by
every process (``mem_get_info``), and a peer swap's reserve on the peer's device.

No GPU here: torch.cuda's counters are replaced by a fake allocator that holds 3 GB
between steps and spikes by a different amount inside each step, with a cache above the
live bytes, a CUDA context and another process on the device (as ``torch.cuda.memory``
reads them: ``max_memory_reserved``, ``memory_reserved``, ``mem_get_info`` as free and
total); the trainer is a real one-rank trainer on CPU reading the fake counters of GPU 1
(the rank's own device).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from runtime_helpers import TINY_LLAMA, make_plan, pipe

from potluck.calibrate.compare_memory import compare_memory
from potluck.runtime import Trainer, build_model, parallelize, start
from potluck.runtime.loop.batches import RandomTokens
from potluck.runtime.loop.peak_memory import (
    CudaPeakMemory,
    DevicePeaks,
    ProcessPeakMemory,
    peak_memory,
)
from potluck.runtime.loop.trainer import memory_table, rank_memory_rows
from potluck.runtime.memory.ledger import MemorySample

GB = 1e9
HELD_BYTES = 3 * GB  # weights, states, gradients: allocated between steps
SPIKE_BYTES = (10 * GB, 1 * GB, 2 * GB)  # what each step needs on top
CACHE_BYTES = 0.5 * GB  # the allocator's reserve above its live bytes
CONTEXT_BYTES = 0.6 * GB  # the CUDA context and NCCL: in use, never allocated by torch
OTHER_BYTES = 2 * GB  # another process on the device
TOTAL_BYTES = 80 * GB
RANK_GPU = torch.device("cuda", 1)


class FakeAllocator:
    """torch.cuda's memory counters of one device, per call: what the trainer asks, when."""

    def __init__(self) -> None:
        self.peak_bytes = HELD_BYTES + 20 * GB  # start-up left a large peak behind
        self.reserved_peak = self.peak_bytes + CACHE_BYTES
        self.events: list[tuple[str, object]] = []

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        self.events.append(("reset", device))
        self.peak_bytes = HELD_BYTES
        self.reserved_peak = self.reserved_now()

    def max_memory_allocated(self, device: torch.device) -> int:
        self.events.append(("read", device))
        return int(self.peak_bytes)

    def max_memory_reserved(self, device: torch.device) -> int:
        return int(self.reserved_peak)

    def memory_reserved(self, device: torch.device) -> int:
        return int(self.reserved_now())

    def reserved_now(self) -> float:
        return HELD_BYTES + CACHE_BYTES  # empty_cache is never called: blocks stay cached

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        used = self.reserved_now() + CONTEXT_BYTES + OTHER_BYTES
        return int(TOTAL_BYTES - used), int(TOTAL_BYTES)

    def spike(self, nbytes: float) -> None:
        self.events.append(("step", nbytes))
        self.peak_bytes = max(self.peak_bytes, HELD_BYTES + nbytes)
        self.reserved_peak = max(self.reserved_peak, self.peak_bytes + CACHE_BYTES)


def _fake_cuda(monkeypatch, allocator: FakeAllocator) -> None:
    for name in ("reset_peak_memory_stats", "max_memory_allocated", "max_memory_reserved",
                 "memory_reserved", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, getattr(allocator, name))


def test_a_gpu_rank_meters_its_own_device_and_a_cpu_rank_its_process():
    meter = peak_memory(RANK_GPU)
    assert isinstance(meter, CudaPeakMemory) and meter.device == RANK_GPU
    assert isinstance(peak_memory(torch.device("cpu")), ProcessPeakMemory)


def test_each_step_reports_its_own_peak_after_a_reset_of_its_devices_counter(monkeypatch):
    allocator = FakeAllocator()
    _fake_cuda(monkeypatch, allocator)
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 2, 1)])
    session = start(plan, timeout_s=60)
    try:
        model = parallelize(build_model(plan.model), session, count_memory=True)
        trainer = Trainer(model)
        trainer.memory = CudaPeakMemory(RANK_GPU)
        forward_backward = model.forward_backward

        def spiking(rows: torch.Tensor, scale: float):
            allocator.spike(SPIKE_BYTES[trainer.step_index])
            return forward_backward(rows, scale)

        model.forward_backward = spiking
        data = RandomTokens(plan.model.vocab_size, plan.training.seq_len, plan.training.global_batch)
        steps = [trainer.step(data.global_batch(step)) for step in range(3)]
    finally:
        session.close()
    assert [m.peak_memory_gb for m in steps] == pytest.approx(
        [(HELD_BYTES + s) / GB for s in SPIKE_BYTES])
    resets = [i for i, event in enumerate(allocator.events) if event[0] == "reset"]
    per_step = [allocator.events[i:j] for i, j in zip(resets, [*resets[1:], None], strict=True)]
    for events, spike in zip(per_step, SPIKE_BYTES, strict=True):  # reset, step, then reads
        assert events[:3] == [("reset", RANK_GPU), ("step", spike), ("read", RANK_GPU)]
        assert set(events[3:]) <= {("read", RANK_GPU)}
    for metrics, spike in zip(steps, SPIKE_BYTES, strict=True):
        (row,) = metrics.memory
        reserved = HELD_BYTES + spike + CACHE_BYTES  # this step's own peak reserve
        assert row["reserved_bytes"] == pytest.approx(reserved)
        assert row["used_bytes"] == pytest.approx(reserved + CONTEXT_BYTES + OTHER_BYTES)


# --- a peer swap's stash counts on the peer's device ------------------------------------------
PEER_GPU = torch.device("cuda", 2)


class FakeDevices:
    """Per-device fake counters: a dict of device -> FakeAllocator behind torch.cuda's calls."""

    def __init__(self, devices: dict[torch.device, FakeAllocator]) -> None:
        self.devices = devices

    def __getattr__(self, name: str):
        return lambda device: getattr(self.devices[device], name)(device)


def test_a_meter_reads_its_device_and_its_swap_peers_reserve_and_use(monkeypatch):
    own, peer = FakeAllocator(), FakeAllocator()
    devices = FakeDevices({RANK_GPU: own, PEER_GPU: peer})
    _fake_cuda(monkeypatch, devices)
    meter = peak_memory(RANK_GPU, {"gpu.0:2": PEER_GPU})
    meter.start()
    assert [e for e in own.events + peer.events if e[0] == "reset"] == [
        ("reset", RANK_GPU), ("reset", PEER_GPU)]
    own.spike(4 * GB)
    peer.spike(1 * GB)  # the stash this rank keeps on its peer
    mine, theirs = meter.device_peaks(), meter.peer_peaks()
    assert mine == DevicePeaks(HELD_BYTES + 4 * GB, HELD_BYTES + 4 * GB + CACHE_BYTES,
                               HELD_BYTES + 4 * GB + CACHE_BYTES + CONTEXT_BYTES + OTHER_BYTES)
    assert theirs == {"gpu.0:2": DevicePeaks(HELD_BYTES + GB, HELD_BYTES + GB + CACHE_BYTES,
                                             HELD_BYTES + GB + CACHE_BYTES + CONTEXT_BYTES
                                             + OTHER_BYTES)}
    cpu = ProcessPeakMemory()
    assert (cpu.device_peaks(), cpu.peer_peaks()) == (None, {})


class FixedMeter:
    """A meter's figures at a step's end."""

    def __init__(self, own: DevicePeaks, peers: dict[str, DevicePeaks]) -> None:
        self.own, self.peers = own, peers

    def peak_bytes(self) -> float:
        return self.own.allocated_bytes

    def device_peaks(self) -> DevicePeaks:
        return self.own

    def peer_peaks(self) -> dict[str, DevicePeaks]:
        return self.peers


def _rank(rank: int, devices: tuple[str, ...]) -> SimpleNamespace:
    """What memory_table reads of a ParallelModel on a GPU rank (its ledger: stashes)."""
    held = {devices[1]: 0.3 * GB} if rank == 0 else {}
    ledger = SimpleNamespace(peak=lambda: MemorySample(0.0, 0.0, held))
    return SimpleNamespace(
        layout=SimpleNamespace(rank=rank, world_size=len(devices), device_of_rank=devices),
        session=SimpleNamespace(device=torch.device("cpu"), use_gpu=True), ledger=ledger)


def test_peer_reserve_reaches_the_rows_and_compare_counts_it_on_the_peer():
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 2, 4)])
    devices = plan.devices
    swapper = FixedMeter(DevicePeaks(5 * GB, 6 * GB, 8 * GB),
                         {devices[1]: DevicePeaks(0.3 * GB, 0.4 * GB, 0.0)})
    holder = FixedMeter(DevicePeaks(3 * GB, 3.5 * GB, 5 * GB), {})
    tables = [memory_table(_rank(r, devices), meter) for r, meter in enumerate((swapper, holder))]
    rows = rank_memory_rows(_rank(0, devices), tables[0] + tables[1])  # the all-reduce's sum
    assert rows[0]["reserved_bytes"] == 6 * GB and rows[0]["used_bytes"] == 8 * GB
    assert rows[0]["reserved_on"] == {devices[1]: 0.4 * GB}
    assert rows[0]["held_on"] == {devices[1]: 0.3 * GB} and rows[1]["reserved_on"] == {}
    first, last = compare_memory(plan, [rows])
    assert (first.measured_reserved_bytes, first.measured_used_bytes) == (6 * GB, 8 * GB)
    assert last.measured_reserved_bytes == pytest.approx(3.9 * GB)  # its own and the stash's
    assert last.measured_used_bytes == 5 * GB  # mem_get_info counts every process already
    assert last.measured_device_bytes == pytest.approx(3.3 * GB)  # as before: + held_on
