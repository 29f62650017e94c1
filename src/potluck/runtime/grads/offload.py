"""Optimizer offload (ZeRO-Offload, Ren et al. ATC'21): optimizer states and step in host memory.

:class:`HostOffloadOptimizer` wraps any torch optimizer. It is itself a torch
optimizer over the device parameters (so step hooks such as ZeRO-1's, the
learning rate in its param groups and DCP's FQN-keyed state dicts work as
before), but the wrapped optimizer steps an **fp32 master copy** of each
parameter held in host memory (pinned on a GPU rank, a separate set of CPU
tensors on a CPU rank) and keeps its states there. A step:

1. copies each gradient to a host buffer (device to host; on a GPU
   asynchronously into pinned memory, then one synchronize);
2. runs the wrapped optimizer on the host masters;
3. copies the masters back into the device parameters. On a GPU the copies
   run in forward order on a side stream, one event per parameter, and a
   forward pre-hook on each module waits only for its own parameters' copies,
   so the copy of later blocks' parameters overlaps the next forward pass;
   when something reads the parameters right after the step (ZeRO's
   all-gather), :meth:`wait_for_parameters` waits for all of them.

The host gradient buffers live only for the step, so what stays in host
memory is ``4 + optimizer bytes`` per parameter (master + states), as the
memory contract counts; :meth:`host_state_tensors` lists those tensors (for
the memory ledger). Numerics equal the plain optimizer's: the parameters are
fp32 already, so the master is an exact copy and the update is the same
elementwise arithmetic on the same numbers. On a GPU computing in 16 bits the
device then keeps 16-bit parameters and gradients
(:meth:`keep_device_parameters_in`, ZeRO-Offload's layout and the cost model's):
the update still runs on the FP32 masters, and the device copy is their rounding.
Their gradients are summed over micro-batches in FP32
(:mod:`~potluck.runtime.grads.fp32_accumulation`, reset by :meth:`zero_grad`).
The loss scale is divided out and clipping applied (:meth:`scale_gradients`) in FP32 on
the host copies of the gradients, never on 16-bit ones (fp16 would flush the products
under 6e-8 to zero).
With ZeRO-1/2 only the owned share gets masters and states (``keep``). A parameter written outside the step
(a checkpoint loaded into the model) is noticed by its version counter and its
master refreshed before the next update.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from potluck.runtime.grads.buckets import local
from potluck.runtime.grads.fp32_accumulation import FP32Accumulation


class HostOffloadOptimizer(torch.optim.Optimizer):
    """``optimizer``'s update of ``keep``-ed parameters done on host masters (module doc)."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 keep: Callable[[nn.Parameter], bool] | None = None, *,
                 modules: Iterable[nn.Module] = ()) -> None:
        groups = [dict(group) for group in optimizer.param_groups]
        super().__init__(groups, optimizer.defaults)
        self.inner = optimizer
        self._masters: dict[int, torch.Tensor] = {}
        self._params: dict[int, nn.Parameter] = {}
        self._versions: dict[int, int] = {}
        self._events: dict[int, Any] = {}
        self._coefficient = 1.0  # the next step's gradients are multiplied by it on the host
        self._accumulation: FP32Accumulation | None = None  # with 16-bit device parameters
        for group, inner_group in zip(self.param_groups, optimizer.param_groups, strict=True):
            masters = []
            for param in group["params"]:
                if keep is None or keep(param):
                    masters.append(self._master_of(param))
            inner_group["params"] = masters
        on_gpu = any(p.is_cuda for p in self._params.values())
        self._stream = torch.cuda.Stream() if on_gpu else None
        if on_gpu:
            for module in modules:
                module.register_forward_pre_hook(self._wait_for_module)

    def _master_of(self, param: nn.Parameter) -> torch.Tensor:
        value = local(param).detach()
        master = torch.empty(value.shape, dtype=torch.float32, device="cpu",
                             pin_memory=value.is_cuda)
        master.copy_(value)
        self._masters[id(param)] = master
        self._params[id(param)] = param
        self._versions[id(param)] = local(param)._version
        return master

    def keep_device_parameters_in(self, parameters: Iterable[nn.Parameter],
                                  dtype: torch.dtype) -> None:
        """Hold ``parameters`` on the device in the 16-bit ``dtype`` from now on (ZeRO-Offload's
        layout: 16-bit weights and gradients on the GPU, the FP32 master on the host), their
        gradients summed over micro-batches in FP32
        (:class:`~potluck.runtime.grads.fp32_accumulation.FP32Accumulation`). Call it after
        the masters are made, so they keep the exact FP32 values."""
        cast = [p for p in parameters if p.is_floating_point() and p.dtype != dtype]
        for param in cast:
            _cast_in_place(param, dtype)
        self._accumulation = FP32Accumulation(cast)
        for key, param in self._params.items():
            self._versions[key] = local(param)._version

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self._accumulation is not None:
            self._accumulation.reset()

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
        for key, master in self._masters.items():
            master.grad = None
            if master in self.inner.state:
                self.state[self._params[key]] = self.inner.state[master]
        self._masters_to_device()
        return loss

    def _refresh_stale_masters(self) -> None:
        for key, param in self._params.items():
            if local(param)._version != self._versions[key]:
                self._masters[key].copy_(local(param).detach())
                self._versions[key] = local(param)._version

    def _grads_to_host(self) -> None:
        on_gpu = self._stream is not None
        grads = []
        for key, param in self._params.items():
            master = self._masters[key]
            if param.grad is None:
                master.grad = None
                continue
            master.grad = torch.empty(master.shape, dtype=master.dtype, pin_memory=on_gpu)
            master.grad.copy_(local(param.grad), non_blocking=on_gpu)
            grads.append(master.grad)
        if on_gpu:
            torch.cuda.current_stream().synchronize()
        if grads and self._coefficient != 1.0:
            torch._foreach_mul_(grads, self._coefficient)
        self._coefficient = 1.0

    def _masters_to_device(self) -> None:
        if self._stream is None:
            for key, param in self._params.items():
                local(param).copy_(self._masters[key])
                self._versions[key] = local(param)._version
            return
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for key, param in self._params.items():
                local(param).copy_(self._masters[key], non_blocking=True)
                self._versions[key] = local(param)._version
                event = torch.cuda.Event()
                event.record(self._stream)
                self._events[key] = event

    def _wait_for_module(self, module: nn.Module, args: Any) -> None:
        for param in module._parameters.values():
            if param is not None and (event := self._events.pop(id(param), None)) is not None:
                torch.cuda.current_stream().wait_event(event)

    def wait_for_parameters(self) -> None:
        """Make the current stream wait for every parameter copied back by the last step."""
        stream = torch.cuda.current_stream() if self._stream is not None else None
        for event in self._events.values():
            stream.wait_event(event)
        self._events.clear()

    # --- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The states as torch saves them, a DTensor parameter's as DTensors of its layout."""
        self.wait_for_parameters()
        saved = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        for index, state in saved["state"].items():
            param = params[index]
            if isinstance(param, DTensor):
                saved["state"][index] = {k: _as_dtensor(v, param) for k, v in state.items()}
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load states (torch puts them on the parameters' device), then move them to the
        host masters' side and refresh the masters from the (already loaded) parameters."""
        self.wait_for_parameters()
        super().load_state_dict(state_dict)
        for key, param in self._params.items():
            master = self._masters[key]
            master.copy_(local(param).detach())
            self._versions[key] = local(param)._version
            if param in self.state:
                host = {k: _to_host(v, master.is_pinned()) for k, v in self.state[param].items()}
                self.inner.state[master] = host
                self.state[param] = host


def _cast_in_place(param: nn.Parameter, dtype: torch.dtype) -> None:
    """``param`` holds ``dtype`` values from now on, as the same object (its hooks and
    optimizer entries stay). A DTensor keeps its local shard and its spec (whose metadata
    has the dtype) as Python attributes that ``.data`` does not reach, and ``to_local()``
    under autograd is a view whose ``.data`` leaves the DTensor as it was: both are
    replaced by the cast's."""
    with torch.no_grad():
        cast = param.to(dtype)
    param.data = cast
    if isinstance(param, DTensor):
        param._local_tensor = cast._local_tensor
        param._spec = cast._spec


def _as_dtensor(value: Any, param: DTensor) -> Any:
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
            and value.shape == local(param).shape and value.dim() > 0:
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return value


def _to_host(value: Any, pin: bool) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    value = local(value)
    if value.dim() == 0:
        return value.cpu()  # a step count stays a CPU scalar, as torch keeps it
    host = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pin)
    return host.copy_(value)
