"""The global gradient norm: every parameter counted once across TP, PP and DP shards, from
foreach norms of the gradients as they are (no FP64 or any other copy of a gradient)."""

from __future__ import annotations

import math

import torch
from runtime_helpers import TINY_LLAMA, make_plan, pipe
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from potluck.runtime import build_model, parallelize, start
from potluck.runtime.grads.data_parallel import sum_of_squares
from potluck.runtime.launch.local import run_local
from potluck.runtime.loop.batches import RandomTokens

# two replicas of a pipeline of two stages, the second split over two TP ranks
PLAN = make_plan(TINY_LLAMA, [pipe([(1, (0, 2)), (2, (2, 4))], 1, 2)] * 2)


class _NewBytes(TorchDispatchMode):
    """Bytes of the tensors that ops make in new storage (views and in-place results not)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors(args)}
        for tensor in _tensors(out):
            if tensor.untyped_storage().data_ptr() not in inputs:
                self.bytes += tensor.numel() * tensor.element_size()
        return out


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value._local_tensor if isinstance(value, DTensor) else value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _norm_of_rank(plan) -> tuple[float, float, int, int]:
    """The step's global norm as the runtime computes it; the norm of every whole gradient
    this rank holds (its stage's, after the gradient sum); the bytes the norm's own part
    allocated and the bytes of this rank's gradients."""
    session = start(plan, timeout_s=60)
    try:
        model = parallelize(build_model(plan.model), session)
        shape = plan.training
        data = RandomTokens(plan.model.vocab_size, shape.seq_len, shape.global_batch)
        output = model.forward_backward(data.replica_rows(0, *session.layout.batch_rows))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        with _NewBytes() as counted:
            model.grad_sync.norm_squared()
        whole = [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]
        stage_norm = float(torch.nn.utils.get_total_norm(whole, 2.0))
        grad_bytes = sum(g.numel() * g.element_size() for g in _tensors(grads))
        return output.grad_norm, stage_norm, counted.bytes, grad_bytes
    finally:
        session.close()


def test_the_global_norm_counts_each_parameter_once_and_copies_no_gradient():
    reports = run_local(_norm_of_rank, PLAN.devices, (PLAN,), timeout_s=120)
    stage_norms = {round(stage, 5) for _, stage, _, _ in reports}
    assert len(stage_norms) == 2  # replicas and TP ranks agree on their stage's gradients
    expected = math.sqrt(sum(norm * norm for norm in stage_norms))
    for grad_norm, _, new_bytes, grad_bytes in reports:
        assert grad_norm == reports[0][0]
        assert math.isclose(grad_norm, expected, rel_tol=1e-5)
        assert new_bytes < grad_bytes / 100  # scalars only, no copy of the gradients


def test_sixteen_bit_tensors_are_reduced_in_fp32():
    ones = torch.ones(70_000, dtype=torch.bfloat16)  # a bf16 sum would stop at 256 per step
    total = sum_of_squares([ones, torch.full((3,), 2.0)])
    assert total.dtype == torch.float64
    assert math.isclose(float(total), 70_012.0, rel_tol=1e-6)
