"""16-bit weights on the device, FP32 master copies in the optimizer (mixed-precision
training, Micikevicius et al., ICLR'18; Megatron-LM's and DeepSpeed's layout).

Under ``execution.fp32_params: false`` a GPU rank computing in 16 bits holds its weights
(and so their gradients) in the 16-bit compute dtype, and :class:`MasterWeightsOptimizer`
wraps the torch optimizer: it is itself a torch optimizer over the device parameters (step
hooks such as ZeRO-1's, the learning rate in its param groups and DCP's FQN-keyed state
dicts work as before), while the wrapped optimizer steps an **FP32 master copy** of each
parameter it keeps, on the same device. With ZeRO-1/2 only the owned share gets masters
(``keep``): the other replicas' parameters arrive by the parameter all-gather, in 16 bits.
Under ZeRO-3 FSDP2's mixed precision does the same (FP32 shards, 16-bit gathers;
:mod:`~potluck.runtime.grads.zero3`), so this class is not used there.

Between micro-batches a parameter holds no 16-bit gradient, only its FP32 sum
(:mod:`~potluck.runtime.grads.fp32_accumulation`, as Megatron-LM's ``main_grad``): 2 bytes
of weight, 4 of gradient sum and 12/d of master and moments (``formulas.MAIN_GRAD_MASTER``).
A step: each kept gradient is read in FP32, multiplied by the loss scale's inverse
and the clipping factor in FP32 (:meth:`scale_gradients`; a 16-bit product would round,
and in fp16 flush values under 6e-8 to zero), the wrapped optimizer updates the masters,
and the device parameters become the masters' rounding. Updates smaller than a 16-bit
weight's resolution add up in the master instead of vanishing.

Checkpoints hold the masters: each kept parameter's optimizer state carries its ``master``
beside the wrapped optimizer's states, so a resumed run continues from the FP32 values
and not from their rounding; states are loaded through the wrapped optimizer, which keeps
them in FP32 (torch's ``Optimizer.load_state_dict`` casts floating states to the dtype of
the parameter they belong to, here 16 bits).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from potluck.runtime.grads.buckets import local
from potluck.runtime.grads.fp32_accumulation import FP32Accumulation

MASTER = "master"  # the optimizer-state key of a parameter's FP32 master copy


class MasterWeightsOptimizer(torch.optim.Optimizer):
    """``optimizer``'s update of ``keep``-ed parameters done on FP32 masters (module doc)."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 keep: Callable[[nn.Parameter], bool] | None = None) -> None:
        groups = [dict(group) for group in optimizer.param_groups]
        super().__init__(groups, optimizer.defaults)
        self.inner = optimizer
        self._masters: dict[int, torch.Tensor] = {}
        self._params: dict[int, nn.Parameter] = {}
        self._coefficient = 1.0
        self._accumulation: FP32Accumulation | None = None
        for group, inner_group in zip(self.param_groups, optimizer.param_groups, strict=True):
            inner_group["params"] = [self._master_of(p) for p in group["params"]
                                     if keep is None or keep(p)]

    def _master_of(self, param: nn.Parameter) -> torch.Tensor:
        master = local(param).detach().to(torch.float32, copy=True)
        self._masters[id(param)] = master
        self._params[id(param)] = param
        return master

    def keep_device_parameters_in(self, parameters: Iterable[nn.Parameter],
                                  dtype: torch.dtype, finals: Mapping[int, int] | None = None
                                  ) -> FP32Accumulation:
        """Hold ``parameters`` in the 16-bit ``dtype`` from now on, their gradients summed
        over micro-batches in FP32 (``finals``:
        :class:`~potluck.runtime.grads.fp32_accumulation.FP32Accumulation`'s). Call it after
        the masters are made (they keep the exact FP32 values)."""
        cast = [p for p in parameters if p.is_floating_point() and p.dtype != dtype]
        for param in cast:
            cast_in_place(param, dtype)
        self._accumulation = FP32Accumulation(cast, finals)
        return self._accumulation

    def masters(self) -> list[torch.Tensor]:
        """The FP32 master copies this rank keeps."""
        return list(self._masters.values())

    def master_of(self, param: nn.Parameter) -> torch.Tensor | None:
        """``param``'s FP32 master (None: the optimizer does not keep it)."""
        return self._masters.get(id(param))

    @torch.no_grad()
    def masters_changed(self) -> None:
        """The masters were written outside a step (an outer step): copy them to the
        parameters."""
        for key, param in self._params.items():
            local(param).copy_(self._masters[key])

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self._accumulation is not None:
            self._accumulation.reset()

    def scale_gradients(self, coefficient: float) -> None:
        """Have the next step multiply the gradients by ``coefficient`` in FP32."""
        self._coefficient = coefficient

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure() if closure is not None else None
        grads = []
        for key, param in self._params.items():
            master = self._masters[key]
            master.grad = None if param.grad is None else local(param.grad).to(torch.float32)
            if master.grad is not None:
                grads.append(master.grad)
        if grads and self._coefficient != 1.0:
            torch._foreach_mul_(grads, self._coefficient)
        self._coefficient = 1.0
        for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner_group.update({k: v for k, v in group.items() if k != "params"})
        self.inner.step()
        for key, param in self._params.items():
            self._masters[key].grad = None
            local(param).copy_(self._masters[key])
        self.state = master_states(self.inner, self._params, self._masters)
        return loss

    # --- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The states as torch saves them (the masters among them), a DTensor parameter's as
        DTensors of its layout."""
        return with_dtensor_states(self, super().state_dict())

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the masters and the wrapped optimizer's states in FP32 (see the module doc);
        a parameter saved without a master gets one from its loaded value."""
        load_masters(self, self.inner, self._masters, state_dict)
        for key, param in self._params.items():
            local(param).copy_(self._masters[key])
        self.state = master_states(self.inner, self._params, self._masters)


def with_dtensor_states(optimizer: torch.optim.Optimizer, saved: dict[str, Any]
                        ) -> dict[str, Any]:
    """``saved`` (``optimizer``'s torch state dict) with a DTensor parameter's states as
    DTensors of its layout, as DCP saves a sharded parameter's (a wrapper keeps them as the
    local tensors its masters have)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, state in saved["state"].items():
        param = params[index]
        if isinstance(param, DTensor):
            saved["state"][index] = {k: as_dtensor(v, param) for k, v in state.items()}
    return saved


def master_states(inner: torch.optim.Optimizer, params: dict[int, nn.Parameter],
                  masters: dict[int, torch.Tensor]) -> defaultdict[Any, dict[str, Any]]:
    """A wrapper's state: each parameter's wrapped-optimizer state (kept on its master)
    with the master itself under :data:`MASTER`, so checkpoints carry the FP32 values."""
    state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
    for key, param in params.items():
        master = masters[key]
        if master in inner.state:
            state[param] = {**inner.state[master], MASTER: master}
    return state


def load_masters(wrapper: torch.optim.Optimizer, inner: torch.optim.Optimizer,
                 masters: dict[int, torch.Tensor], state_dict: dict[str, Any]) -> None:
    """Load a wrapper's ``state_dict`` (over its parameters) into ``inner`` (over their FP32
    ``masters``, by ``id`` of the parameter), so torch casts the states to the masters'
    dtype and device, not to the 16-bit parameters'; copy each saved master into its
    master (a checkpoint without one: the parameter's value). The wrapper's param groups
    take the saved settings."""
    # saved keys (indices, or FQNs under DCP) name parameters in group order, as torch maps them
    saved_keys = [k for group in state_dict["param_groups"] for k in group["params"]]
    params = [p for group in wrapper.param_groups for p in group["params"]]
    param_of = dict(zip(saved_keys, params, strict=True))
    inner_index = {id(m): i for i, m in
                   enumerate(m for group in inner.param_groups for m in group["params"])}
    inner_state: dict[int, dict[str, Any]] = {}
    for key, state in state_dict["state"].items():
        master = masters.get(id(param_of[key]))
        if master is None:
            continue
        saved = state.get(MASTER)
        master.copy_(local(saved) if saved is not None else local(param_of[key]).detach())
        inner_state[inner_index[id(master)]] = {k: local(v) for k, v in state.items()
                                                if k != MASTER}
    groups = [{**group, "params": [inner_index[id(masters[id(param_of[k])])]
                                   for k in group["params"] if id(param_of[k]) in masters]}
              for group in state_dict["param_groups"]]
    inner.load_state_dict({"state": inner_state, "param_groups": groups})
    for group, saved_group in zip(wrapper.param_groups, state_dict["param_groups"], strict=True):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def cast_in_place(param: nn.Parameter, dtype: torch.dtype) -> None:
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


def as_dtensor(value: Any, param: DTensor) -> Any:
    """A state tensor of a DTensor parameter's local shape as a DTensor of its layout (what
    DCP saves for a sharded parameter)."""
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
            and value.shape == local(param).shape and value.dim() > 0:
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return value
