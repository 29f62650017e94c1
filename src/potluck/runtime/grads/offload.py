"""Optimizer offload (ZeRO-Offload, Ren et al. ATC'21): optimizer states and step in host memory.

:class:`HostOffloadOptimizer` wraps any torch optimizer. It is itself a torch
optimizer over the device parameters (so step hooks such as ZeRO-1's, the
learning rate in its param groups and DCP's FQN-keyed state dicts work as
before), but the wrapped optimizer steps an **fp32 master copy** of each
parameter held in host memory (pinned on a GPU rank, a separate set of CPU
tensors on a CPU rank) and keeps its states there. A step:

1. copies each gradient to a host buffer (device to host). Each copy starts as soon as
   the gradient is final for the step, while the backward pass goes on (ZeRO-Offload's
   overlap): a gradient that no replica sums after its last micro-batch's accumulation
   (:meth:`copy_when_final` counts post-accumulate-grad hooks), a summed one once
   :class:`~potluck.runtime.grads.data_parallel.GradSync` has written its bucket's sum
   back (:meth:`grads_final`, after the schedule); whatever neither found final is copied
   when the step starts. On a GPU each copy runs on a copy stream of its own
   (``out``) after the compute stream's work so far, non-blocking into pinned
   memory, with an event per batch of copies; the host step waits for those events
   only, never for the device (no ``synchronize``);
2. runs the wrapped optimizer on the host masters;
3. copies the masters back into the device parameters (rounded to their 16 bits on the
   host, into pinned memory). On a GPU the copies run non-blocking in forward order on a
   second stream (``back``), one event per parameter, and a forward pre-hook on
   each module makes the compute stream wait for its own parameters' copies only, so the
   copy of later blocks' parameters overlaps the next forward pass; when something reads
   the parameters right after the step (ZeRO's all-gather), :meth:`wait_for_parameters`
   makes it wait for all of them.

The host gradient buffers live from the backward pass to the step, so what stays in host
memory is ``4 + optimizer bytes`` per parameter (master + states), as the
memory contract counts; :meth:`host_state_tensors` lists those tensors (for
the memory ledger). Numerics equal the plain optimizer's: the parameters are
fp32 already, so the master is an exact copy and the update is the same
elementwise arithmetic on the same numbers. On a GPU computing in 16 bits the
device then keeps 16-bit parameters and final gradients
(:meth:`keep_device_parameters_in`, ZeRO-Offload's layout and the cost model's):
the update still runs on the FP32 masters, and the device copy is their rounding.
Their gradients are summed over micro-batches in FP32, held as that sum alone until
the last micro-batch (:mod:`~potluck.runtime.grads.fp32_accumulation`, reset by
:meth:`zero_grad`).
The loss scale is divided out and clipping applied (:meth:`scale_gradients`) in FP32 on
the host copies of the gradients, never on 16-bit ones (fp16 would flush the products
under 6e-8 to zero).
With ZeRO-1/2 only the owned share gets masters and states (``keep``). A parameter written
outside the step (weights loaded into the model alone) is noticed by its version counter
and its master refreshed before the next update. Checkpoints carry the masters, and states
load in FP32 on the host (:func:`~potluck.runtime.grads.master_weights.load_masters`), so
a resumed run with 16-bit device weights continues from the FP32 values, not their rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from potluck.runtime.grads.buckets import local
from potluck.runtime.grads.fp32_accumulation import FP32Accumulation
from potluck.runtime.grads.master_weights import (
    cast_in_place,
    load_masters,
    master_states,
    with_dtensor_states,
)
from potluck.runtime.memory.swap import CopyStreams


class HostOffloadOptimizer(torch.optim.Optimizer):
    """``optimizer``'s update of ``keep``-ed parameters done on host masters (module doc)."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 keep: Callable[[nn.Parameter], bool] | None = None, *,
                 modules: Iterable[nn.Module] = (), device: torch.device | None = None) -> None:
        """``modules``: those whose forward waits for its parameters' copies back (GPU);
        ``device``: the GPU whose streams copy (default: the parameters' GPU if any; a CPU
        rank copies in place, with no streams)."""
        device = device or next((p.device for group in optimizer.param_groups
                                 for p in group["params"] if p.is_cuda), None)
        groups = [dict(group) for group in optimizer.param_groups]
        super().__init__(groups, optimizer.defaults)
        self.inner = optimizer
        self._masters: dict[int, torch.Tensor] = {}
        self._params: dict[int, nn.Parameter] = {}
        self._versions: dict[int, int] = {}
        self._events: dict[int, Any] = {}  # parameter copied back -> its copy's event
        # this step's gradients on the host: parameter -> (buffer, the copy's event or None)
        self._host_grads: dict[int, tuple[torch.Tensor, Any]] = {}
        self._hooks_when_final: dict[int, int] = {}  # copy_when_final's parameters
        self._hooks: dict[int, int] = {}  # ... and their hooks so far this step
        self._coefficient = 1.0  # the next step's gradients are multiplied by it on the host
        self._accumulation: FP32Accumulation | None = None  # with 16-bit device parameters
        for group, inner_group in zip(self.param_groups, optimizer.param_groups, strict=True):
            masters = []
            for param in group["params"]:
                if keep is None or keep(param):
                    masters.append(self._master_of(param, pin=device is not None))
            inner_group["params"] = masters
        self._streams = CopyStreams(device) if device is not None else None
        if self._streams is not None:
            for module in modules:
                module.register_forward_pre_hook(self._wait_for_module)

    def _master_of(self, param: nn.Parameter, pin: bool) -> torch.Tensor:
        value = local(param).detach()
        master = _host_buffer(value, pin)
        master.copy_(value)
        self._masters[id(param)] = master
        self._params[id(param)] = param
        self._versions[id(param)] = local(param)._version
        return master

    def keep_device_parameters_in(self, parameters: Iterable[nn.Parameter],
                                  dtype: torch.dtype, finals: Mapping[int, int] | None = None
                                  ) -> FP32Accumulation:
        """Hold ``parameters`` on the device in the 16-bit ``dtype`` from now on (ZeRO-Offload's
        layout: 16-bit weights and gradients on the GPU, the FP32 master on the host), their
        gradients summed over micro-batches in FP32
        (:class:`~potluck.runtime.grads.fp32_accumulation.FP32Accumulation`, with its
        ``finals``). Call it after the masters are made, so they keep the exact FP32 values."""
        cast = [p for p in parameters if p.is_floating_point() and p.dtype != dtype]
        for param in cast:
            cast_in_place(param, dtype)
        self._accumulation = FP32Accumulation(cast, finals)
        for key, param in self._params.items():
            self._versions[key] = local(param)._version
        return self._accumulation

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._drop_host_grads()  # a skipped step's copies: done before the gradients change
        super().zero_grad(set_to_none)
        if self._accumulation is not None:
            self._accumulation.reset()

    def copy_when_final(self, hooks: Iterable[tuple[nn.Parameter, int]]) -> None:
        """Copy each parameter's gradient to the host as soon as its post-accumulate-grad
        hook has run the given number of times this step (the micro-batches times the
        hooks of one accumulation; for gradients no replica sums afterwards). A hook beyond
        that number means the gradient changed after all: it is copied again at the step.
        A gradient written without hooks (zero bubble's weight pass) is copied at the step."""
        for param, count in hooks:
            if id(param) in self._masters:
                self._hooks_when_final[id(param)] = count
                param.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, param: nn.Parameter) -> None:
        key = id(param)
        count = self._hooks[key] = self._hooks.get(key, 0) + 1
        if count == self._hooks_when_final[key]:
            self.grads_final([param])
        elif count > self._hooks_when_final[key]:
            self._host_grads.pop(key, None)

    def grads_final(self, params: Iterable[nn.Parameter]) -> None:
        """Start copying the gradients of ``params`` to the host (those with a master and a
        gradient, not copied yet this step): nothing writes them again before the step. On
        a GPU the copies wait for the compute stream's work so far (which made them) and
        run on the ``out`` copy stream, non-blocking into pinned memory; the host waits for
        them at the step."""
        todo = []
        for param in params:
            key = id(param)
            if key in self._masters and key not in self._host_grads \
                    and param.grad is not None and _in_parameter_layout(param):
                todo.append((key, local(param.grad).detach()))
        if not todo:
            return
        if self._streams is None:
            for key, grad in todo:
                self._host_grads[key] = (_host_buffer(grad, pin=False).copy_(grad), None)
            return
        streams = self._streams
        streams.out.wait_stream(streams.compute())
        with torch.cuda.stream(streams.out):
            done = torch.cuda.Event()
            for key, grad in todo:
                buffer = _host_buffer(grad, pin=True)
                buffer.copy_(grad, non_blocking=True)
                grad.record_stream(streams.out)  # not reused before the copy is done
                self._host_grads[key] = (buffer, done)
            done.record(streams.out)

    def _drop_host_grads(self) -> None:
        """Forget this step's host gradients (the compute stream waits for copies still
        running, so nothing overwrites a gradient they read) and hook counts."""
        if self._streams is not None:
            compute = self._streams.compute()
            for event in {id(e): e for _, e in self._host_grads.values()}.values():
                compute.wait_event(event)
        self._host_grads.clear()
        self._hooks.clear()

    def scale_gradients(self, coefficient: float) -> None:
        """Have the next step multiply the gradients by ``coefficient`` (the loss scale
        divided out and clipping, :func:`~potluck.runtime.parallel_model.grad_coefficient`)
        in FP32, on their host copies: on 16-bit device gradients the products would round
        to 16 bits, and in fp16 those under 6e-8 would become zero."""
        self._coefficient = coefficient

    def host_state_tensors(self) -> list[torch.Tensor]:
        """Every host-resident tensor this optimizer keeps: the fp32 masters and the
        wrapped optimizer's states (the memory ledger's "host bytes" of optimizer offload)."""
        tensors = list(self._masters.values())
        for state in self.inner.state.values():
            tensors += [value for value in state.values()
                        if isinstance(value, torch.Tensor) and value.dim() > 0]
        return tensors

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure() if closure is not None else None
        self._refresh_stale_masters()
        self._grads_to_host()
        for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner_group.update({k: v for k, v in group.items() if k != "params"})
        self.inner.step()
        for master in self._masters.values():
            master.grad = None
        self.state = master_states(self.inner, self._params, self._masters)
        self._masters_to_device()
        return loss

    def master_of(self, param: nn.Parameter) -> torch.Tensor | None:
        """``param``'s FP32 host master (None: the optimizer does not keep it)."""
        return self._masters.get(id(param))

    @torch.no_grad()
    def masters_changed(self) -> None:
        """The masters were written outside a step (an outer step): copy them to the
        device parameters, as a step does."""
        self._masters_to_device()

    def _refresh_stale_masters(self) -> None:
        for key, param in self._params.items():
            if local(param)._version != self._versions[key]:
                self._masters[key].copy_(local(param).detach())
                self._versions[key] = local(param)._version

    def _grads_to_host(self) -> None:
        """The masters' gradients: the host copies, each waited for by its own event."""
        self.grads_final(self._params.values())  # those nothing found final before
        grads, waited = [], set()
        for key, master in self._masters.items():
            buffer, done = self._host_grads.pop(key, (None, None))
            if done is not None and id(done) not in waited:
                done.synchronize()
                waited.add(id(done))
            master.grad = buffer
            if buffer is not None:
                grads.append(buffer)
        self._host_grads.clear()
        self._hooks.clear()
        if grads and self._coefficient != 1.0:
            torch._foreach_mul_(grads, self._coefficient)
        self._coefficient = 1.0

    def _masters_to_device(self) -> None:
        if self._streams is None:
            for key, param in self._params.items():
                local(param).copy_(self._masters[key])
                self._versions[key] = local(param)._version
            return
        streams = self._streams
        streams.back.wait_stream(streams.compute())  # the step's reads of the weights
        with torch.cuda.stream(streams.back):
            for key, param in self._params.items():
                target, master = local(param), self._masters[key]
                if target.dtype != master.dtype:  # rounded here: the copy stays asynchronous
                    master = _host_buffer(target, True, target.dtype).copy_(master)
                target.copy_(master, non_blocking=True)
                self._versions[key] = target._version
                event = torch.cuda.Event()
                event.record(streams.back)
                self._events[key] = event

    def _wait_for_module(self, module: nn.Module, args: Any) -> None:
        for param in module._parameters.values():
            if param is not None and (event := self._events.pop(id(param), None)) is not None:
                self._streams.compute().wait_event(event)

    def wait_for_parameters(self) -> None:
        """Make the current stream wait for every parameter copied back by the last step."""
        for event in self._events.values():
            self._streams.compute().wait_event(event)
        self._events.clear()

    # --- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The states as torch saves them, a DTensor parameter's as DTensors of its layout."""
        self.wait_for_parameters()
        return with_dtensor_states(self, super().state_dict())

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the masters and the wrapped optimizer's states into host memory in FP32
        (:func:`~potluck.runtime.grads.master_weights.load_masters`: torch would cast them
        to the dtype of 16-bit device parameters), then give the device parameters the
        masters' values."""
        self.wait_for_parameters()
        load_masters(self, self.inner, self._masters, state_dict)
        for key, param in self._params.items():
            local(param).copy_(self._masters[key])
            self._versions[key] = local(param)._version
        self.state = master_states(self.inner, self._params, self._masters)


def _host_buffer(like: torch.Tensor, pin: bool, dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
    """An empty host tensor of ``like``'s shape: FP32 unless ``dtype``; pinned if ``pin``."""
    return torch.empty(like.shape, dtype=dtype or torch.float32, device="cpu", pin_memory=pin)


def _in_parameter_layout(param: nn.Parameter) -> bool:
    """Whether ``param``'s gradient has its parameter's placements (a DTensor gradient may
    not until :class:`~potluck.runtime.grads.data_parallel.GradSync` redistributes it)."""
    grad = param.grad
    return not isinstance(grad, DTensor) or tuple(grad.placements) == tuple(param.placements)
