"""The default AdamW runs torch's fused kernel on GPUs and on offloaded host masters, its
foreach kernels elsewhere, and updates as the plain one-tensor-at-a-time AdamW does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from potluck.plans.memory import Offload
from potluck.runtime.grads.offload import HostOffloadOptimizer
from potluck.runtime.loop.trainer import default_optimizer


def _model(device_type: str, offload: Offload) -> SimpleNamespace:
    """What :func:`default_optimizer` reads of a ParallelModel: its device, its stage's
    offload and its parameters (on CPU: the device is only named)."""
    torch.manual_seed(0)
    module = nn.Linear(8, 4)
    memory = SimpleNamespace(offload=offload)
    plan = SimpleNamespace(stage_memory=lambda pipeline, stage: memory)
    layout = SimpleNamespace(role=SimpleNamespace(pipeline=0, stage=0), plan=plan)
    return SimpleNamespace(session=SimpleNamespace(device=torch.device(device_type)),
                           layout=layout, parameters=module.parameters, module=module)


@pytest.mark.parametrize(("device_type", "offload", "fused"), [
    ("cuda", Offload.NONE, True),
    ("cuda", Offload.OPTIMIZER, True),
    ("cpu", Offload.OPTIMIZER, True),  # the step runs on host masters
    ("cpu", Offload.NONE, False),
])
def test_fused_on_gpus_and_host_masters_foreach_elsewhere(device_type, offload, fused):
    group = default_optimizer(_model(device_type, offload), lr=1e-3).param_groups[0]
    assert group["fused"] is fused
    assert group["foreach"] is (not fused)


def test_the_fused_offloaded_step_matches_plain_adamw():
    plain, offloaded = _model("cpu", Offload.NONE), _model("cpu", Offload.OPTIMIZER)
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2, betas=(0.9, 0.95),
                                  weight_decay=0.0, foreach=False)
    offload = HostOffloadOptimizer(default_optimizer(offloaded, lr=1e-2))
    for step in range(3):
        torch.manual_seed(step)
        batch = torch.randn(5, 8)
        for model, optimizer in ((plain, reference), (offloaded, offload)):
            optimizer.zero_grad()
            model.module(batch).square().mean().backward()
            optimizer.step()
    for mine, expected in zip(offloaded.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(mine, expected, rtol=1e-6, atol=1e-7)
