"""ZeRO-1/2's parameter all-gathers left in flight into the next step (dp priority schedule).

Under ``plan.comm.dp_priority_schedule`` a step does not wait for the updated parameters
to arrive from their owners (:class:`~potluck.runtime.grads.zero.Zero1`).
:meth:`ParameterGathers.launch`, right after the optimizer step, starts every bucket's
all-gather in the order the next forward needs them: the reverse of the order in which a
backward pass finishes the buckets (:mod:`potluck.runtime.grads.buckets`), so the tied
weight and the embedding first, then the blocks from first to last, the head last. That
order is a pure function of the plan, so every rank of each group launches the same
collectives in the same order, whatever the timing. Each is handed to the model's clock
(``start_comm``: the model wraps ``clock.start_comm``), which may stand in for torch's
handle (emulation).

A forward pre-hook on each module that holds parameters of a bucket
(:meth:`ParameterGathers.hook`) waits for that module's buckets only and writes their
values back, so later buckets travel while earlier blocks compute. :meth:`flush` waits
for whatever is still in flight; the model calls it before anything else reads
parameters (a state dict, a checkpoint saved or loaded, the end of training) and, at the
latest, when the next step's first gradient reduction starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from potluck.runtime.grads.buckets import Bucket
from potluck.runtime.grads.zero import Zero1

GatherPoint = tuple[nn.Module, tuple[int, ...]]  # a module and the buckets it waits for


class Waitable(Protocol):
    """torch's handle of a collective, or a clock's stand-in for it."""

    def wait(self) -> Any: ...


StartComm = Callable[[Bucket, Any], Waitable]  # (bucket, torch's handle) -> what to wait on


def bucket_units(bucket: Bucket) -> tuple[str, ...]:
    """The parameter units (``embed``, ``block.3``, ``head``) a bucket carries, in order."""
    return tuple(dict.fromkeys(item.unit for item in bucket.items))


def forward_order(buckets: Sequence[Bucket]) -> tuple[int, ...]:
    """Bucket indices in the order a forward pass first uses them (backward order reversed)."""
    return tuple(reversed(range(len(buckets))))


def gather_points(modules: Sequence[nn.Module], buckets: Sequence[Bucket],
                  recurse: bool) -> list[GatherPoint]:
    """Each of ``modules`` that holds parameters of some bucket, with those buckets' indices
    in launch order: only the module's own parameters, or (``recurse``) its submodules' too."""
    index = {id(item.param): i for i, bucket in enumerate(buckets) for item in bucket.items}
    points = []
    for module in modules:
        found = {index[id(p)] for p in module.parameters(recurse=recurse) if id(p) in index}
        if found:
            points.append((module, tuple(sorted(found, reverse=True))))
    return points


class ParameterGathers:
    """The parameter all-gathers still in flight, by bucket index."""

    def __init__(self, zero: Zero1, start_comm: StartComm) -> None:
        """``start_comm``: hands a started all-gather to the model's current clock."""
        self.zero = zero
        self.start_comm = start_comm
        self.order = forward_order(zero.buckets)
        self._pending: dict[int, tuple[Waitable, Callable[[], None]]] = {}

    @property
    def pending(self) -> tuple[int, ...]:
        """The buckets whose values have not been written back yet, in launch order."""
        return tuple(self._pending)

    def launch(self) -> None:
        """After the optimizer step: start every bucket's all-gather, in forward order."""
        self.flush()
        for index in self.order:
            bucket = self.zero.buckets[index]
            work, write_back = self.zero.launch_gather(bucket)
            self._pending[index] = (self.start_comm(bucket, work), write_back)

    @torch.no_grad()
    def wait(self, index: int) -> None:
        """Wait for bucket ``index`` and write its values back (nothing if it is not pending)."""
        entry = self._pending.pop(index, None)
        if entry is not None:
            work, write_back = entry
            work.wait()
            write_back()

    def flush(self) -> None:
        """Wait for every bucket still in flight, in launch order."""
        for index in self.pending:
            self.wait(index)

    def hook(self, points: Sequence[GatherPoint]) -> None:
        """Before each module of ``points`` runs, wait for its buckets (once per step)."""
        for module, indices in points:
            module.register_forward_pre_hook(self._waiter(indices))

    def _waiter(self, indices: tuple[int, ...]) -> Callable[[nn.Module, Any], None]:
        def wait_for_buckets(module: nn.Module, args: Any) -> None:
            if self._pending:
                for index in indices:
                    self.wait(index)

        return wait_for_buckets
