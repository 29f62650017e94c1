"""An offloaded optimizer on a 16-bit device: 16-bit parameters there, exact FP32 masters on
the host, and the update computed on the masters (ZeRO-Offload's layout)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from bf16_passes import micro_batch, ones_times, weight_pass
from dist_harness import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from potluck.runtime.grads.offload import HostOffloadOptimizer
from potluck.runtime.loop.trainer import Trainer
from potluck.runtime.parallel_model import ParallelModel


def _layer() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(8, 4)


def test_device_parameters_turn_16_bit_while_the_masters_keep_the_fp32_values():
    layer = _layer()
    exact = [p.detach().clone() for p in layer.parameters()]
    offload = HostOffloadOptimizer(torch.optim.AdamW(layer.parameters(), lr=1e-2))
    offload.keep_device_parameters_in(layer.parameters(), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in layer.parameters())
    masters = offload.host_state_tensors()
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(torch.equal(m, e) for m, e in zip(masters, exact, strict=True))


def test_a_step_updates_the_fp32_masters_and_rounds_them_onto_the_device():
    plain, sixteen = _layer(), _layer()
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    offload = HostOffloadOptimizer(torch.optim.AdamW(sixteen.parameters(), lr=1e-2))
    offload.keep_device_parameters_in(sixteen.parameters(), torch.bfloat16)
    for _ in range(3):
        batch = torch.randn(5, 8)
        for layer, optimizer in ((plain, reference), (sixteen, offload)):
            optimizer.zero_grad()
            layer(batch.to(next(layer.parameters()).dtype)).float().square().mean().backward()
            optimizer.step()
    masters = offload.host_state_tensors()[:2]
    for master, device, fp32 in zip(masters, sixteen.parameters(), plain.parameters(),
                                    strict=True):
        assert torch.equal(device, master.to(torch.bfloat16))  # the device copy is its rounding
        assert torch.allclose(master, fp32, atol=2e-2)  # bf16 forward, same FP32 update
        assert not torch.equal(master, master.to(torch.bfloat16).float())  # FP32 kept


def _tp_shards_turn_16_bit(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    layer = parallelize_module(_layer(), mesh, ColwiseParallel())
    offload = HostOffloadOptimizer(torch.optim.AdamW(layer.parameters(), lr=1e-2))
    offload.keep_device_parameters_in(layer.parameters(), torch.bfloat16)
    for param in layer.parameters():
        assert isinstance(param, DTensor) and param.dtype == torch.bfloat16
        assert param.to_local().dtype == torch.bfloat16  # the shard the forward computes with
    torch.manual_seed(1)
    batch = torch.randn(5, 8, dtype=torch.bfloat16)
    layer(batch).float().square().mean().backward()
    once = [p.grad.to_local().clone() for p in layer.parameters()]
    layer(batch).float().square().mean().backward()  # a second micro-batch, summed in FP32
    for param, grad in zip(layer.parameters(), once, strict=True):
        assert param.grad.to_local().dtype == torch.bfloat16
        assert torch.equal(param.grad.to_local(), 2 * grad)
    offload.step()
    masters = offload.host_state_tensors()[:2]
    for master, param in zip(masters, layer.parameters(), strict=True):
        assert master.dtype == torch.float32
        assert torch.equal(param.to_local(), master.to(torch.bfloat16))


def test_tensor_parallel_parameters_turn_16_bit_too():
    run_ranks(_tp_shards_turn_16_bit, 2, timeout_s=60)


class _FakeModel:
    """What ``Trainer._update_or_skip`` uses of a ParallelModel, around one layer."""

    unscale_and_clip = ParallelModel.unscale_and_clip
    zero = None
    priority = False
    counts_memory = True
    ledger = SimpleNamespace(add_host_tensors=lambda tensors: None,
                             count_states=lambda *args, **kwargs: None)
    clock = SimpleNamespace(run=lambda kind, index, work: work())

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def parameters(self):
        return self.layer.parameters()

    def sync_parameters(self) -> None:
        pass


def test_fp16_gradients_are_unscaled_in_fp32():
    """fp16 has nothing under 6e-8: a true gradient of 2^-30 survives only in FP32."""
    layer = nn.Linear(4, 1, bias=False)
    nn.init.zeros_(layer.weight)
    offload = HostOffloadOptimizer(torch.optim.SGD(layer.parameters(), lr=1.0))
    offload.keep_device_parameters_in(layer.parameters(), torch.float16)
    trainer = Trainer.__new__(Trainer)
    trainer.model, trainer.optimizer = _FakeModel(layer), offload
    trainer.max_grad_norm, trainer.loss_scale = None, None
    scale = 2.0 ** 16
    layer.weight.grad = torch.full_like(layer.weight, 2.0 ** -30 * scale)  # as backward left it
    trainer._update_or_skip(SimpleNamespace(grads_finite=True, grad_norm=2.0 ** -29), scale)
    master = offload.host_state_tensors()[0]
    assert torch.equal(master, torch.full_like(master, -2.0 ** -30))  # SGD, lr 1: minus the grad


def _bf16_weight() -> tuple[nn.Linear, HostOffloadOptimizer]:
    layer = nn.Linear(4, 1, bias=False)
    offload = HostOffloadOptimizer(torch.optim.SGD(layer.parameters(), lr=1.0))
    offload.keep_device_parameters_in(layer.parameters(), torch.bfloat16)
    return layer, offload


def test_bf16_gradients_are_summed_over_micro_batches_in_fp32():
    """bf16 keeps 8 bits of mantissa: a bf16 sum of ones stops at 256."""
    layer, offload = _bf16_weight()
    for _ in range(300):
        micro_batch(layer)
    assert torch.equal(layer.weight.grad, ones_times(layer, 300))
    offload.zero_grad(set_to_none=False)
    for _ in range(3):
        micro_batch(layer)
    assert torch.equal(layer.weight.grad, ones_times(layer, 3))  # the next step starts over


def test_the_fp32_sum_takes_weight_passes_and_starts_over_when_the_grad_is_taken():
    layer, _ = _bf16_weight()
    for _ in range(300):  # zero bubble's weight passes
        weight_pass(layer)
    assert torch.equal(layer.weight.grad, ones_times(layer, 300))
    layer.weight.grad = None  # ZeRO-2 took the sum to reduce-scatter it
    micro_batch(layer)
    micro_batch(layer)
    assert torch.equal(layer.weight.grad, ones_times(layer, 2))
