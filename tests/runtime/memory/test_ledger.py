"""The ledger counts what a rank holds: states by storage, saved tensors while autograd
keeps them, host-resident states as host bytes."""

from __future__ import annotations

import torch
from torch import nn

from potluck.runtime.memory.ledger import MemoryLedger


def test_saved_tensors_count_once_per_storage_until_their_backward():
    ledger = MemoryLedger()
    layer = nn.Linear(64, 64, bias=False)
    ledger.count_states(layer.parameters())
    weight_bytes = 64 * 64 * 4
    assert ledger.now().device_bytes == weight_bytes
    x = torch.randn(8, 64, requires_grad=True)
    with ledger.saving():
        hidden = layer(x).relu()  # linear keeps x (a leaf) and its weight; relu its output
        y = hidden * hidden[:, :1]  # two views of one storage: counted once
    saved = ledger.now().device_bytes - weight_bytes
    assert saved == 8 * 64 * 4 * 2  # x and relu's output; the weight is a parameter
    y.sum().backward()  # frees what autograd saved (the `hidden` variable is not saved)
    assert ledger.now().device_bytes == weight_bytes
    assert ledger.peak().device_bytes == weight_bytes + saved


def test_states_registered_as_host_tensors_are_host_bytes():
    ledger = MemoryLedger()
    layer = nn.Linear(16, 16)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    moments = [v for state in optimizer.state.values() for k, v in state.items() if k != "step"]
    params = 16 * 16 + 16
    ledger.count_states(layer.parameters(), optimizer)
    assert ledger.now().device_bytes == params * 4 * 4  # weights, grads, two moments
    ledger.add_host_tensors(moments)
    ledger.count_states(layer.parameters(), optimizer)
    now = ledger.now()
    assert (now.device_bytes, now.host_bytes) == (params * 4 * 2, params * 4 * 2)


def test_a_stash_splits_into_fixed_pieces_and_hybrid_sends_its_share_to_host():
    from potluck.plans.memory import Swap
    from potluck.runtime.memory.ledger import Place
    from potluck.runtime.memory.swap import SwapTarget

    cpu = torch.device("cpu")
    host = SwapTarget(Swap.HOST, cpu, chunk_bytes=4)
    assert host.split(10) == [(Place.HOST, 0, 4), (Place.HOST, 4, 8), (Place.HOST, 8, 10)]
    assert SwapTarget(Swap.PEER, cpu, cpu, "cpu.0:1").split(3) == [(Place.PEER, 0, 3)]
    hybrid = SwapTarget(Swap.HYBRID, cpu, cpu, "cpu.0:1", host_share=0.3, chunk_bytes=4)
    assert hybrid.split(10) == [(Place.HOST, 0, 3), (Place.PEER, 3, 7), (Place.PEER, 7, 10)]
