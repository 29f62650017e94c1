"""``peak_memory_gb`` on a GPU is each step's own peak: CUDA's peak counter of the rank's
device is restarted when a step starts, so neither start-up (materializing the weights)
nor an earlier, larger step inflates a later step's figure.

No GPU here: torch.cuda's two counters are replaced by a fake allocator that holds 3 GB
between steps and spikes by a different amount inside each step; the trainer is a real
one-rank trainer on CPU reading the fake counters of GPU 1 (the rank's own device).
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import TINY_LLAMA, make_plan, pipe

from potluck.runtime import Trainer, build_model, parallelize, start
from potluck.runtime.loop.batches import RandomTokens
from potluck.runtime.loop.peak_memory import CudaPeakMemory, ProcessPeakMemory, peak_memory

GB = 1e9
HELD_BYTES = 3 * GB  # weights, states, gradients: allocated between steps
SPIKE_BYTES = (10 * GB, 1 * GB, 2 * GB)  # what each step needs on top
RANK_GPU = torch.device("cuda", 1)


class FakeAllocator:
    """torch.cuda's allocated-bytes peak, per call: what the trainer asks and when."""

    def __init__(self) -> None:
        self.peak_bytes = HELD_BYTES + 20 * GB  # start-up left a large peak behind
        self.events: list[tuple[str, object]] = []

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        self.events.append(("reset", device))
        self.peak_bytes = HELD_BYTES

    def max_memory_allocated(self, device: torch.device) -> int:
        self.events.append(("read", device))
        return int(self.peak_bytes)

    def spike(self, nbytes: float) -> None:
        self.events.append(("step", nbytes))
        self.peak_bytes = max(self.peak_bytes, HELD_BYTES + nbytes)


def test_a_gpu_rank_meters_its_own_device_and_a_cpu_rank_its_process():
    meter = peak_memory(RANK_GPU)
    assert isinstance(meter, CudaPeakMemory) and meter.device == RANK_GPU
    assert isinstance(peak_memory(torch.device("cpu")), ProcessPeakMemory)


def test_each_step_reports_its_own_peak_after_a_reset_of_its_devices_counter(monkeypatch):
    allocator = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", allocator.reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", allocator.max_memory_allocated)
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 2, 1)])
    session = start(plan, timeout_s=60)
    try:
        model = parallelize(build_model(plan.model), session)
        trainer = Trainer(model)
        trainer.memory = CudaPeakMemory(RANK_GPU)
        forward_backward = model.forward_backward

        def spiking(rows: torch.Tensor, scale: float):
            allocator.spike(SPIKE_BYTES[trainer.step_index])
            return forward_backward(rows, scale)

        model.forward_backward = spiking
        data = RandomTokens(plan.model.vocab_size, plan.training.seq_len, plan.training.global_batch)
        peaks = [trainer.step(data.global_batch(step)).peak_memory_gb for step in range(3)]
    finally:
        session.close()
    assert peaks == pytest.approx([(HELD_BYTES + s) / GB for s in SPIKE_BYTES])
    per_step = [allocator.events[i:i + 3] for i in range(0, len(allocator.events), 3)]
    assert per_step == [[("reset", RANK_GPU), ("step", s), ("read", RANK_GPU)]
                        for s in SPIKE_BYTES]
