"""16-bit weights with FP32 master copies in the optimizer: the masters follow plain FP32
AdamW exactly, the device weights are their rounding, updates under a 16-bit weight's
resolution are kept, loss scale and clipping apply in FP32, and a checkpoint round trip
keeps the masters and moments in FP32."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from potluck.runtime.grads.master_weights import MASTER, MasterWeightsOptimizer
from potluck.runtime.loop import trainer as trainer_module

SHAPE = (16, 8)


def _grads(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return [torch.randn(SHAPE, generator=generator) * 1e-3, torch.randn(8, generator=generator)]


def _pair(lr: float = 1e-3) -> tuple[list[nn.Parameter], MasterWeightsOptimizer,
                                     list[nn.Parameter], torch.optim.Optimizer]:
    torch.manual_seed(0)
    reference = [nn.Parameter(torch.randn(SHAPE)), nn.Parameter(torch.randn(8))]
    device = [nn.Parameter(p.detach().clone()) for p in reference]
    wrapped = MasterWeightsOptimizer(torch.optim.AdamW(device, lr=lr))
    wrapped.keep_device_parameters_in(device, torch.bfloat16)
    plain = torch.optim.AdamW(reference, lr=lr)
    return device, wrapped, reference, plain


def _step(params, optimizer, grads, dtype=None) -> None:
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.to(dtype or param.dtype)
    optimizer.step()
    optimizer.zero_grad()


def test_masters_follow_fp32_adamw_and_the_weights_are_their_rounding():
    device, wrapped, reference, plain = _pair()
    assert all(p.dtype == torch.bfloat16 for p in device)
    for step in range(3):
        grads = [g.to(torch.bfloat16).float() for g in _grads(step)]  # what the device holds
        _step(device, wrapped, grads)
        _step(reference, plain, grads)
    for master, param, expected in zip(wrapped.masters(), device, reference, strict=True):
        assert master.dtype == torch.float32
        assert torch.equal(master, expected.detach())
        assert torch.equal(param.detach(), expected.detach().to(torch.bfloat16))


def test_updates_under_a_16_bit_weights_resolution_add_up_in_the_master():
    """lr 1e-4 on weights of about 1: each step moves a weight by 1e-4, under bf16's
    resolution there (2^-7): the 16-bit weights alone would never move."""
    device, wrapped, _, _ = _pair(lr=1e-4)
    start = [m.clone() for m in wrapped.masters()]
    for _ in range(50):
        _step(device, wrapped, [torch.ones(SHAPE), torch.ones(8)])
    moved = [float((s - m).min()) for m, s in zip(wrapped.masters(), start, strict=True)]
    assert all(change > 4e-3 for change in moved)  # 50 steps of about 1e-4 each, every weight


def test_loss_scale_and_clipping_apply_to_fp32_gradients():
    """A gradient of 2^-20 under a loss scale of 2^16 unscaled in FP32 gives AdamW's step,
    not a zero: the same masters as plain AdamW fed the unscaled gradient."""
    device, wrapped, reference, plain = _pair()
    scale = 2.0**16
    grads = [torch.full(SHAPE, 2.0**-20), torch.full((8,), 2.0**-20)]
    wrapped.scale_gradients(1.0 / scale)
    _step(device, wrapped, [g * scale for g in grads])
    _step(reference, plain, grads)
    for master, expected in zip(wrapped.masters(), reference, strict=True):
        assert torch.allclose(master, expected.detach(), rtol=0, atol=1e-7)


def test_a_checkpoint_round_trip_keeps_masters_and_moments_in_fp32():
    device, wrapped, _, _ = _pair(lr=1e-4)
    for step in range(5):
        _step(device, wrapped, _grads(step))
    saved = copy.deepcopy(wrapped.state_dict())  # as written to disk: no tensor shared
    assert all(state[MASTER].dtype == torch.float32 for state in saved["state"].values())
    fresh = [nn.Parameter(p.detach().clone()) for p in device]  # the checkpoint's 16-bit weights
    restored = MasterWeightsOptimizer(torch.optim.AdamW(fresh, lr=1e-4))
    restored.keep_device_parameters_in(fresh, torch.bfloat16)
    restored.load_state_dict(saved)
    for mine, theirs in zip(restored.masters(), wrapped.masters(), strict=True):
        assert torch.equal(mine, theirs)  # not the rounding of the 16-bit weights
    for state in restored.inner.state.values():
        assert state["exp_avg"].dtype == torch.float32
    _step(device, wrapped, _grads(9))
    _step(fresh, restored, _grads(9))
    for mine, theirs in zip(restored.masters(), wrapped.masters(), strict=True):
        assert torch.equal(mine, theirs)


def _fake_model(*, gpu: bool, fp32_params: bool, zero: int = 0, offload: bool = False):
    plan = SimpleNamespace(training=SimpleNamespace(execution=SimpleNamespace(fp32_params=fp32_params)),
                           zero=zero, dp=2 if zero else 1)
    params = [nn.Parameter(torch.randn(4))]
    return SimpleNamespace(session=SimpleNamespace(use_gpu=gpu, autocast_dtype=torch.bfloat16),
                           layout=SimpleNamespace(plan=plan), zero=None,
                           parameters=lambda: iter(params), final_accumulations=dict,
                           sum_grads_in_fp32=lambda accumulation: None), offload


@pytest.mark.parametrize(("gpu", "fp32_params", "zero", "offload", "wrapped"), [
    (True, False, 0, False, True),
    (True, True, 0, False, False),  # FP32 weights under autocast
    (False, False, 0, False, False),  # CPU ranks train in FP32
    (True, False, 3, False, False),  # FSDP2's mixed precision keeps FP32 shards
    (True, False, 0, True, False),  # offload keeps its masters on the host
])
def test_gpu_ranks_get_16_bit_weights_where_the_plan_says_so(monkeypatch, gpu, fp32_params,
                                                              zero, offload, wrapped):
    model, offloads = _fake_model(gpu=gpu, fp32_params=fp32_params, zero=zero, offload=offload)
    monkeypatch.setattr(trainer_module, "_offloads", lambda _model: offloads)
    monkeypatch.setattr(trainer_module, "shards_parameters", lambda plan: plan.zero == 3)
    optimizer = torch.optim.AdamW(list(model.parameters()))
    result = trainer_module.with_masters(model, optimizer)
    assert isinstance(result, MasterWeightsOptimizer) is wrapped
    param = next(model.parameters())
    assert param.dtype == (torch.bfloat16 if wrapped else torch.float32)


def test_offload_checkpoints_keep_fp32_masters_and_moments_of_16_bit_weights():
    """The same round trip through optimizer offload: torch's load would cast the moments to
    the 16-bit parameters' dtype and the masters came back as the weights' rounding."""
    from potluck.runtime.grads.offload import HostOffloadOptimizer

    def offloaded(params):
        optimizer = HostOffloadOptimizer(torch.optim.AdamW(params, lr=1e-4))
        optimizer.keep_device_parameters_in(params, torch.bfloat16)
        return optimizer

    torch.manual_seed(0)
    device = [nn.Parameter(torch.randn(SHAPE)), nn.Parameter(torch.randn(8))]
    wrapped = offloaded(device)
    for step in range(5):
        _step(device, wrapped, _grads(step))
    saved = copy.deepcopy(wrapped.state_dict())
    fresh = [nn.Parameter(p.detach().clone()) for p in device]
    restored = offloaded(fresh)
    restored.load_state_dict(saved)
    for mine, theirs in zip(restored.host_state_tensors(), wrapped.host_state_tensors(),
                            strict=True):
        assert mine.dtype == torch.float32 and torch.equal(mine, theirs)


def test_16_bit_weights_hold_only_the_fp32_sum_between_micro_batches_and_sum_over_replicas():
    """dp=2, four micro-batches, wired as a GPU rank computing in bf16 gets it: no gradient
    is held when a micro-batch starts (only the FP32 sums), no bucket keeps a 16-bit view
    between steps, and the summed gradients are the FP32 run's within bf16's precision."""
    from dp_workers import grads_in_16_bits
    from runtime_helpers import TINY_LLAMA, make_plan, pipe

    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 1, 4)] * 2)
    reference = grads_in_16_bits(plan, bf16=False)[0][0]
    for rank, (grads, held, views) in enumerate(grads_in_16_bits(plan, bf16=True)):
        assert held == [False] * 4, f"rank {rank}: a gradient held between micro-batches"
        assert views == 0, f"rank {rank}: a bucket of 16-bit gradients kept as a view"
        for name, grad in grads.items():
            scale = abs(reference[name]).max() + 1e-6
            assert abs(grad - reference[name]).max() <= 0.05 * scale, name
