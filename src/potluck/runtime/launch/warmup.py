"""Every communicator of the run, made and used once before the first step.

NCCL creates a group's communicator lazily, at its first collective, and a
point-to-point communicator for each pair of ranks at their first send or
receive outside a batch (``ProcessGroupNCCL::pointToPoint``: single sends and
receives keep a two-rank communicator of their own, batched ones use the
group's). Left lazy, every one of them would be created inside step 1, some from
gradient hooks on the autograd thread, and a step-1 hang would look like a slow
first step. :func:`warm_up` instead runs, from the main thread right after the
groups are made: one small all-reduce on every group this rank is in, then one
send between each pair of neighbouring stages on each of its pipeline lanes (the
forward lane and, with split P2P channels, the backward one). Each rank takes
its part in one order shared by all ranks (groups in creation order, then the
lanes' pairs in lane order), so no two ranks wait on each other crosswise.
On gloo the same calls only confirm that every group is connected; a host-staged
cross-island group (gloo beside NCCL) is used with a host tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from potluck.runtime.layout import Layout


def warm_up(layout: Layout, device: torch.device) -> None:
    """Use every process group of ``layout`` this rank is in once (see the module docstring)."""
    for ranks, group in layout.member_groups():
        on = torch.device("cpu") if layout.on_host(ranks) else device
        dist.all_reduce(torch.ones(1, device=on), group=group)
    for group in _lane_groups(layout):
        for pair in layout.lane_neighbours():
            _exchange(layout.rank, pair, group, device)


def _lane_groups(layout: Layout) -> list[dist.ProcessGroup]:
    """This rank's lane groups: the forward lane, and the backward one if it is another."""
    forward, backward = layout.lane_group, layout.lane_group_backward
    groups = [forward] if forward is not None else []
    return groups + ([backward] if backward is not None and backward is not forward else [])


def _exchange(rank: int, pair: tuple[int, int], group: dist.ProcessGroup,
              device: torch.device) -> None:
    """One single (unbatched) send from the pair's first rank to its second."""
    sender, receiver = pair
    token = torch.ones(1, device=device)
    if rank == sender:
        dist.send(token, dst=receiver, group=group)
    else:
        dist.recv(token, src=sender, group=group)
