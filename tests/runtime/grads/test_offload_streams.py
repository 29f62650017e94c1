"""Optimizer offload's copies on a GPU, without one: gradients go to the host on a copy stream
while the backward pass goes on, the host step waits for their events only (never a
``synchronize``), and the updated weights come back on another stream that each module's
next forward waits for.

As in the swap's test (``tests/runtime/memory/test_swap.py``), torch.cuda's streams and events
are fakes with vector clocks, written from torch's source: a stream's work is ordered, and
``wait_stream``/``wait_event`` order it after another stream's work so far, as CUDA does; so
"copy A is done before B starts" is a comparison of clocks. Every ``copy_`` is logged on the
stream current at the time; each module's forward and each gradient accumulation is work on
the compute stream. Host memory is "pinned" where ``torch.empty`` was asked to pin it.
"""

from __future__ import annotations

import pytest
import torch
from fake_streams import FakeEvent, FakeStreams, done_before, storage_key
from torch import nn

from potluck.runtime.grads.offload import HostOffloadOptimizer

CPU = torch.device("cpu")
MICRO_BATCHES = 2


def _device_synchronize(*args: object) -> None:
    raise AssertionError("the offloaded step made the host wait for the whole device")


class FakeCuda(FakeStreams):
    """torch.cuda's streams (the compute stream first), events, and logs of copies and pins."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[FakeEvent] = []
        # stream, clock after queueing it, dst, src, non_blocking
        self.copies: list[tuple[str, dict[str, int], int, int, bool]] = []
        self.pinned: set[int] = set()

    def Event(self) -> FakeEvent:  # noqa: N802
        self.events.append(FakeEvent())
        return self.events[-1]

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False
             ) -> torch.Tensor:
        self.copies.append((self.current.name, self.current.queue(), storage_key(dst), storage_key(src),
                            non_blocking))
        return COPY(dst, src, non_blocking)


COPY = torch.Tensor.copy_
EMPTY = torch.empty


@pytest.fixture
def cuda(monkeypatch) -> FakeCuda:
    fake = FakeCuda()
    for name in ("Stream", "Event", "current_stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "synchronize", _device_synchronize)
    monkeypatch.setattr(torch.Tensor, "copy_", lambda dst, src, non_blocking=False: fake.copy(
        dst, src, non_blocking))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: None)

    def empty(*args, pin_memory: bool = False, **kwargs):
        tensor = EMPTY(*args, **kwargs)
        if pin_memory:
            fake.pinned.add(storage_key(tensor))
        return tensor

    monkeypatch.setattr(torch, "empty", empty)
    return fake


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))


def _offloaded(model: nn.Sequential, device: torch.device | None) -> HostOffloadOptimizer:
    offload = HostOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   modules=model.modules(), device=device)
    offload.keep_device_parameters_in(model.parameters(), torch.bfloat16)
    return offload


def _train(model: nn.Sequential, offload: HostOffloadOptimizer, steps: int,
           on_forward=None) -> None:
    for step in range(steps):
        for micro_batch in range(MICRO_BATCHES):
            torch.manual_seed(100 * step + micro_batch)
            x = torch.randn(5, 8, dtype=torch.bfloat16)
            model(x).float().square().mean().backward()
        offload.step()
        offload.zero_grad(set_to_none=False)


def test_offload_copies_gradients_during_backward_and_weights_back_without_a_host_sync(cuda):
    model = _model()
    params = list(model.parameters())
    offload = _offloaded(model, CPU)
    compute = cuda.streams[0]
    to_host, to_device = (s.name for s in cuda.streams[1:])
    assert len(cuda.streams) == 3  # compute and one copy stream each way
    masters = offload.host_state_tensors()
    assert all(storage_key(m) in cuda.pinned for m in masters)

    # each accumulation: the parameter, its gradient's storage, the compute stream's clock
    # once it is written, and the number of copies logged by then
    accumulated: list[tuple[nn.Parameter, int, dict[str, int], int]] = []

    def accumulate(param: nn.Parameter) -> None:  # runs before the optimizer's own hook
        accumulated.append((param, storage_key(param.grad), compute.queue(), len(cuda.copies)))

    for param in params:
        param.register_post_accumulate_grad_hook(accumulate)
    offload.copy_when_final((p, MICRO_BATCHES) for p in params)
    forwards: list[tuple[nn.Module, dict[str, int]]] = []  # after the optimizer's pre-hooks
    for module in model:
        module.register_forward_pre_hook(lambda m, _: forwards.append((m, compute.queue())))

    steps_seen: list[int] = []  # copies logged when each inner step started
    inner_step = offload.inner.step

    def step_after_waiting(*args, **kwargs):
        d2h = [e for e in cuda.events if e.clock.get(to_host, 0) > 0]
        assert d2h and all(e.waited_by_host for e in d2h), "the host step ran before its copies"
        steps_seen.append(len(cuda.copies))
        return inner_step(*args, **kwargs)

    offload.inner.step = step_after_waiting
    copies_before = len(cuda.copies)
    _train(model, offload, steps=2)

    grads = {storage_key(p.grad): p for p in params}
    weights = {storage_key(p): p for p in params}
    indexed = list(enumerate(cuda.copies))[copies_before:]
    to_host_copies = [(i, c) for i, c in indexed if c[3] in grads]
    back = [c for _, c in indexed if c[2] in weights and c[0] != "compute"]
    assert len(to_host_copies) == 2 * len(params) and len(back) == 2 * len(params)
    for index, (stream, clock, dst, src, non_blocking) in to_host_copies:
        assert stream == to_host and non_blocking and dst in cuda.pinned
        made = [c for _, key, c, n in accumulated if key == src and n <= index][-1]
        assert done_before(made, "compute", clock)  # after the work that made the gradient
    waited = 0
    for stream, clock, dst, src, non_blocking in back:
        assert stream == to_device and non_blocking and src in cuda.pinned
        later = [c for m, c in forwards if any(storage_key(p) == dst for p in m.parameters())
                 and c["compute"] > clock.get("compute", 0)]
        if later:  # the next forward of its module waits for it
            assert done_before(clock, to_device, later[0])
            waited += 1
    assert waited == len(params)  # the first step's: the second step's forward waited
    # overlap: the last layer's gradients went to the host while the backward pass went on
    # (before the first layer's final accumulation), not at the step
    last_copied = next(i for i, c in indexed if grads.get(c[3]) is model[2].weight)
    first_final = [n for p, _, _, n in accumulated if p is model[0].weight][MICRO_BATCHES - 1]
    assert last_copied < first_final
    assert len(steps_seen) == 2 and steps_seen[0] < copies_before + len(params) + len(back)


def test_gradients_go_to_the_host_after_the_last_micro_batch_only(cuda):
    model = _model()
    offload = _offloaded(model, CPU)
    offload.copy_when_final((p, MICRO_BATCHES) for p in model.parameters())
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    model(x).float().square().mean().backward()
    assert not offload._host_grads  # one micro-batch of two: nothing is final yet
    model(x).float().square().mean().backward()
    assert set(offload._host_grads) == {id(p) for p in model.parameters()}
    model(x).float().square().mean().backward()  # one more after all: copied again at the step
    assert not offload._host_grads


def test_the_step_with_copy_streams_equals_the_step_on_a_cpu_rank(cuda):
    """Same masters and device weights, bit for bit, whether the gradients are copied during
    the backward pass on streams or at the step in place."""
    streamed, plain = _model(), _model()
    offloads = [_offloaded(streamed, CPU), _offloaded(plain, None)]
    offloads[0].copy_when_final((p, MICRO_BATCHES) for p in streamed.parameters())
    for model, offload in zip((streamed, plain), offloads, strict=True):
        _train(model, offload, steps=3)
    for a, b in zip(offloads[0].host_state_tensors(), offloads[1].host_state_tensors(),
                    strict=True):
        assert torch.equal(a, b)
    for a, b in zip(streamed.parameters(), plain.parameters(), strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
