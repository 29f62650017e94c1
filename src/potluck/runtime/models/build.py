"""Building models without memory, and initializing them the same way in every layout.

- :func:`meta_init` creates parameters on the meta device (no memory, no
  init work) while buffers such as rotary tables stay real, so a model larger
  than one device can be built and only the local stage is materialized.
- :func:`build_model` makes an unmodified Hugging Face causal LM for a
  :class:`ModelSpec` (from its original ``config.json`` when it has one).
- :func:`materialize` gives every meta parameter of a (possibly sharded,
  possibly partial) module real storage and its deterministic initial value;
  :func:`park_on_meta` first moves a real model's weights aside, so that
  tensor parallelism shards meta tensors and only the shards reach the device.

Initial values depend only on ``(seed, parameter name)``: each parameter is
drawn in full, on the host, from its own generator and then sliced to the local
shard (:func:`~potluck.runtime.shards.host_shard`), which alone goes to the
device, so a single-process run and any pipeline/tensor-parallel layout start
from identical weights and no GPU ever holds a whole sharded parameter. Rules:
norm weights 1, biases 0, every other parameter ``N(0, initializer_range)``
(0.02 unless the config says otherwise).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from enum import Enum
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from potluck.errors import ConfigError
from potluck.model.spec import ModelSpec
from potluck.runtime.shards import host_shard

DEFAULT_INIT_STD = 0.02


class WeightSource(Protocol):
    """Pretrained values by parameter name (:class:`~potluck.runtime.checkpoints.pretrained.\
PretrainedWeights`): this rank's part of a parameter, on the host."""

    def local_value(self, name: str, param: torch.Tensor) -> torch.Tensor: ...


@contextmanager
def meta_init() -> Iterator[None]:
    """Inside, new parameters live on the meta device; buffers stay where they are made."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"),
                                                    requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def hf_config(spec: ModelSpec, attn_implementation: str = "sdpa") -> Any:
    """The Hugging Face config of ``spec`` (:func:`potluck.model.hf.hf_config_for`)."""
    from potluck.model.hf import hf_config_for

    config = hf_config_for(spec)
    config._attn_implementation = attn_implementation
    config.use_cache = False  # training keeps no key/value cache (tracing cannot return one)
    return config


def attention_implementation(flash_attention: bool) -> str:
    """The Hugging Face attention a plan's ``execution.flash_attention`` asks for: SDPA
    (flash/memory-efficient kernels), or ``eager`` (the scores held in memory)."""
    return "sdpa" if flash_attention else "eager"


def build_model(spec: ModelSpec, attn_implementation: str = "sdpa") -> nn.Module:
    """An unmodified ``*ForCausalLM`` for ``spec`` with its parameters on the meta device."""
    from transformers import AutoModelForCausalLM

    if not spec.sdpa:
        attn_implementation = "eager"  # the model has no SDPA path (Gemma 2's soft-capping)
    config = hf_config(spec, attn_implementation)
    with meta_init():
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from the run seed and a parameter's name (stable across runs)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class InitKind(str, Enum):
    ONES = "ones"
    ZEROS = "zeros"
    NORMAL = "normal"


def init_kinds(model: nn.Module) -> dict[str, InitKind]:
    """How each parameter of ``model`` starts: norm weights 1, biases 0, the rest normal.

    Taken from the whole model before it is split (traced stage modules lose
    the module types this looks at).
    """
    kinds = {}
    for name, owner, leaf, _ in _owners(model):
        if "norm" in type(owner).__name__.lower():
            kinds[name] = InitKind.ONES if leaf == "weight" else InitKind.ZEROS
        else:
            kinds[name] = InitKind.ZEROS if leaf == "bias" else InitKind.NORMAL
    return kinds


def initial_value(name: str, kind: InitKind, shape: torch.Size, seed: int,
                  std: float = DEFAULT_INIT_STD) -> torch.Tensor:
    """The full, float32 initial value of parameter ``name``."""
    if kind is InitKind.ONES:
        return torch.ones(shape)
    if kind is InitKind.ZEROS:
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def _owners(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Parameter]]:
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for leaf, param in owner._parameters.items():
            if param is not None:
                full = f"{owner_name}.{leaf}" if owner_name else leaf
                yield full, owner, leaf, param


def materialize(modules: Sequence[nn.Module], device: torch.device, seed: int,
                aliases: dict[str, str] | None = None,
                kinds: dict[str, InitKind] | None = None, std: float | None = None, *,
                host_values: Mapping[str, torch.Tensor] | None = None,
                weights: WeightSource | None = None) -> None:
    """Give every meta parameter of ``modules`` storage on ``device`` and its initial value.

    Parameter names are taken relative to each module (pipeline stages carry the
    model's own names). ``aliases`` maps a name to the name whose value it takes
    (a tied head takes the embedding's); ``kinds`` says how each starts (default:
    :func:`init_kinds` of each module); ``host_values`` holds, by name, the full
    values of parameters that were real before :func:`park_on_meta`; ``weights``, when
    given, the pretrained value of every other meta parameter (each rank reads only its
    shard). Real parameters,
    parked ones included, are moved, not re-initialized; a tensor-parallel shard is cut
    from the full value on the host and only the shard is moved to ``device``.
    Parameters shared between or within modules stay shared.
    """
    aliases = aliases or {}
    std = std if std is not None else init_std(modules)
    done: dict[int, nn.Parameter] = {}
    for module in modules:
        module_kinds = kinds if kinds is not None else init_kinds(module)
        for name, owner, leaf, param in _owners(module):
            if id(param) not in done:
                value_name = aliases.get(name, name)
                kind = module_kinds.get(value_name, InitKind.NORMAL)
                done[id(param)] = _materialized(param, value_name, kind, device, seed, std,
                                                host_values, weights)
            owner._parameters[leaf] = done[id(param)]
        _materialize_buffers(module, device)


def park_on_meta(model: nn.Module) -> dict[str, torch.Tensor]:
    """Swap ``model``'s real parameters for meta ones of the same shape; returns their
    values by name (every name of a shared one), left where they are. Tensor
    parallelism then shards meta tensors, and :func:`materialize` (``host_values``)
    moves only each rank's shard to the device."""
    values: dict[str, torch.Tensor] = {}
    parked: dict[int, nn.Parameter] = {}
    for name, owner, leaf, param in _owners(model):
        if param.device.type == "meta" or isinstance(param, DTensor):
            continue
        values[name] = param.detach()
        if id(param) not in parked:
            parked[id(param)] = nn.Parameter(param.detach().to("meta"),
                                             requires_grad=param.requires_grad)
        owner._parameters[leaf] = parked[id(param)]
    return values


def _materialized(param: nn.Parameter, name: str, kind: InitKind, device: torch.device,
                  seed: int, std: float,
                  host_values: Mapping[str, torch.Tensor] | None,
                  weights: WeightSource | None = None) -> nn.Parameter:
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.device.type != "meta":
        return param if local.device == device else nn.Parameter(param.to(device))
    full = host_values.get(name) if host_values else None
    if full is not None or weights is None:
        full = initial_value(name, kind, param.shape, seed, std) if full is None else full
        shard = host_shard(full, param)
    else:
        shard = weights.local_value(name, param)
    if isinstance(param, DTensor):
        value = DTensor.from_local(shard.to(device), param.device_mesh, param.placements,
                                   run_check=False, shape=param.shape, stride=param.stride())
    else:
        value = shard.to(device)
    return nn.Parameter(value, requires_grad=param.requires_grad)


def init_std(modules: Sequence[nn.Module]) -> float:
    """The normal initial values' spread: the model config's ``initializer_range``. Taken
    from the whole model before it is split (traced stage modules have no config)."""
    for sub in (sub for module in modules for sub in module.modules()):
        config = getattr(sub, "config", None)
        std = getattr(config, "initializer_range", None)
        if isinstance(std, float):
            return std
    return DEFAULT_INIT_STD


def _materialize_buffers(module: nn.Module, device: torch.device) -> None:
    for owner_name, owner in module.named_modules():
        meta = [name for name, buf in owner._buffers.items() if buf is not None and buf.is_meta]
        if meta:
            _rebuild_buffers(owner, owner_name, meta)
        for name, buf in owner._buffers.items():
            if buf is not None and buf.device != device:
                owner._buffers[name] = buf.to(device)


def _rebuild_buffers(owner: nn.Module, owner_name: str, names: list[str]) -> None:
    """Buffers made on the meta device: rebuild them by constructing the module again."""
    config = getattr(owner, "config", None)
    if config is None:
        raise ConfigError(
            f"buffer {owner_name}.{names[0]} is on the meta device and cannot be rebuilt; build "
            "the model inside `potluck.runtime.meta_init()` instead of `torch.device('meta')`"
        )
    with torch.device("cpu"):
        fresh = type(owner)(config)
    for name in names:
        owner._buffers[name] = fresh._buffers[name]


def model_spec(model: nn.Module, name: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of a Hugging Face model instance (to plan for it)."""
    from potluck.model.loading import model_from_hf_config

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ConfigError(f"{type(model).__name__} has no Hugging Face config; describe it "
                          "with a ModelSpec to plan for it")
    return model_from_hf_config(config.to_dict(), name=name or type(model).__name__)
