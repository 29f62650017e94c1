"""16-bit gradients summed in FP32 and held only as that sum until final (Megatron-LM's
``main_grad``): no 16-bit ``.grad`` between micro-batches, the final one exact, and the
cases where a parameter gets fewer or more gradients than the step expects."""

from __future__ import annotations

import torch
from bf16_passes import micro_batch, ones_times, weight_pass
from torch import nn

from potluck.runtime.grads.fp32_accumulation import FP32Accumulation


def _bf16_layer(final: int | None) -> tuple[nn.Linear, FP32Accumulation]:
    layer = nn.Linear(4, 1, bias=False).to(torch.bfloat16)
    finals = None if final is None else {id(layer.weight): final}
    return layer, FP32Accumulation(layer.parameters(), finals)


def test_no_16_bit_gradient_is_held_between_micro_batches_and_the_final_one_is_exact():
    layer, _ = _bf16_layer(final=300)
    for _ in range(299):
        micro_batch(layer)
        assert layer.weight.grad is None  # only the FP32 sum: 4 bytes, not 4 + 2
    micro_batch(layer)
    assert layer.weight.grad.dtype == torch.bfloat16
    assert torch.equal(layer.weight.grad, ones_times(layer, 300))  # a bf16 sum stops at 256


def test_weight_passes_are_summed_once_each():
    layer, _ = _bf16_layer(final=300)
    for _ in range(300):
        weight_pass(layer)
    assert torch.equal(layer.weight.grad, ones_times(layer, 300))


def test_a_step_of_one_micro_batch_keeps_the_gradient_as_it_is():
    layer, _ = _bf16_layer(final=1)
    micro_batch(layer)
    assert torch.equal(layer.weight.grad, ones_times(layer, 1))


def test_fewer_gradients_than_expected_are_written_at_the_schedule_end():
    layer, accumulation = _bf16_layer(final=5)
    for _ in range(3):  # an expert no token was routed to in two micro-batches
        micro_batch(layer)
    assert layer.weight.grad is None
    accumulation.finish()
    assert torch.equal(layer.weight.grad, ones_times(layer, 3))


def test_more_gradients_than_expected_are_still_summed_in_fp32():
    layer, _ = _bf16_layer(final=2)
    for _ in range(300):
        micro_batch(layer)
    assert torch.equal(layer.weight.grad, ones_times(layer, 300))


def test_the_next_step_starts_over_after_reset():
    layer, accumulation = _bf16_layer(final=3)
    for _ in range(3):
        micro_batch(layer)
    layer.weight.grad = None
    accumulation.reset()
    for _ in range(2):
        micro_batch(layer)
    assert layer.weight.grad is None  # not final yet: counts started over
    micro_batch(layer)
    assert torch.equal(layer.weight.grad, ones_times(layer, 3))


def test_without_a_final_count_every_micro_batch_leaves_the_rounding_of_the_sum():
    """ZeRO-2's parameters: the sum is reduce-scattered after every micro-batch."""
    layer, _ = _bf16_layer(final=None)
    for count in range(1, 301):
        micro_batch(layer)
        if count in (1, 300):
            assert torch.equal(layer.weight.grad, ones_times(layer, count))
