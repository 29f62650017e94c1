"""Rank worker for the ZeRO-2 sum test: many micro-batches of 16-bit gradients
reduce-scattered to their owner, whose sum must not lose them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from potluck.runtime.grads.buckets import Bucket, SyncedParam
from potluck.runtime.grads.zero import OwnerSlots
from potluck.runtime.grads.zero2 import ShardedGrads


def sum_bf16_micro_batches(rank: int, world_size: int, micro_batches: int, out: str) -> None:
    """Every rank's bf16 gradient of ones, ``micro_batches`` times; rank 0 owns it.
    Writes the owner's summed gradient value to ``out``."""
    param = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    item = SyncedParam("w", param, "block.0", None)  # type: ignore[arg-type]
    bucket = Bucket(tuple(range(world_size)), True, (item,), dist.group.WORLD)
    members = ((0,),) + ((),) * (world_size - 1)
    slots = OwnerSlots(members, param.numel(), rank)
    sharded = ShardedGrads(None)
    sharded.start()
    for _ in range(micro_batches):
        param.grad = torch.ones_like(param)
        sharded.launch(bucket, slots)
    sharded.write_back(bucket, slots)
    if rank == 0:
        Path(out).write_text(json.dumps(param.grad.float().tolist()))
