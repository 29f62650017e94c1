"""A checkpoint's GPU generator state is the rank's own device's, saved and restored by
that device alone: a checkpoint saved where several GPUs were visible resumes where
fewer are, and CPU and GPU checkpoints resume on the other kind of rank.

No GPU here: torch.cuda's generator functions are replaced by a fake of N visible
devices, each with its own state, that records which device is read and written and
fails (as torch does, indexing ``default_generators``) on a device that is not visible.
Both ``torch.cuda`` and ``torch.cuda.random`` are patched, so ``get_rng_state_all``
and ``set_rng_state_all`` would use the fake too.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from potluck.runtime.checkpoints.rng import load_rng_state, rng_file, save_rng
from potluck.runtime.checkpoints.storage import save_checkpoint


class FakeGpus:
    """``visible`` CUDA devices (none initialized when 0), the current one ``current``."""

    def __init__(self, visible: int, current: int = 0) -> None:
        self.visible = visible
        self.current = current
        self.states = {i: torch.full((16,), 10 + i, dtype=torch.uint8) for i in range(visible)}
        self.reads: list[int] = []
        self.writes: list[tuple[int, torch.Tensor]] = []

    def _index(self, device: int | str | torch.device = "cuda") -> int:
        if isinstance(device, int):
            index = device
        else:
            index = torch.device(device).index
            index = self.current if index is None else index
        if index >= self.visible:
            raise IndexError(f"cuda:{index} is not visible ({self.visible} devices)")
        return index

    def get_rng_state(self, device: int | str | torch.device = "cuda") -> torch.Tensor:
        index = self._index(device)
        self.reads.append(index)
        return self.states[index].clone()

    def set_rng_state(self, state: torch.Tensor, device: int | str | torch.device = "cuda"
                      ) -> None:
        index = self._index(device)
        self.writes.append((index, state.clone()))
        self.states[index] = state.clone()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for module in (torch.cuda, torch.cuda.random):
            monkeypatch.setattr(module, "get_rng_state", self.get_rng_state)
            monkeypatch.setattr(module, "set_rng_state", self.set_rng_state)
            monkeypatch.setattr(module, "device_count", lambda: self.visible)
            monkeypatch.setattr(module, "current_device", lambda: self.current)
            monkeypatch.setattr(module, "is_initialized", lambda: self.visible > 0)


def _saved_cuda(checkpoint: Path) -> torch.Tensor | None:
    with safe_open(str(rng_file(checkpoint, 0)), framework="pt") as file:
        return file.get_tensor("cuda") if "cuda" in file.keys() else None


def test_a_checkpoint_from_gpu_1_of_2_resumes_on_the_only_visible_gpu(tmp_path, monkeypatch):
    saving = FakeGpus(visible=2, current=1)
    saving.install(monkeypatch)
    path = save_checkpoint(tmp_path, 1, {"w": torch.ones(2)}, {"step": 1})
    assert saving.reads == [1], "only the rank's own GPU is read"
    assert torch.equal(_saved_cuda(path), saving.states[1])

    cpu_state = torch.get_rng_state()
    torch.rand(3)  # the CPU generator moves on; the resume must put it back
    resuming = FakeGpus(visible=1, current=0)
    resuming.install(monkeypatch)
    assert load_rng_state(path)
    assert [index for index, _ in resuming.writes] == [0]
    assert torch.equal(resuming.states[0], saving.states[1])
    assert torch.equal(torch.get_rng_state(), cpu_state)


def test_a_cpu_checkpoint_resumes_on_a_gpu_which_keeps_its_generator(tmp_path, monkeypatch):
    FakeGpus(visible=0).install(monkeypatch)
    save_rng(tmp_path)
    assert _saved_cuda(tmp_path) is None
    gpu = FakeGpus(visible=2, current=1)
    gpu.install(monkeypatch)
    assert load_rng_state(tmp_path)
    assert gpu.writes == []


def test_a_gpu_checkpoint_resumes_on_cpu(tmp_path, monkeypatch):
    FakeGpus(visible=4, current=3).install(monkeypatch)
    save_rng(tmp_path)
    assert _saved_cuda(tmp_path) is not None
    python_state = random.getstate()
    random.random()
    FakeGpus(visible=0).install(monkeypatch)
    assert load_rng_state(tmp_path)
    assert random.getstate() == python_state
