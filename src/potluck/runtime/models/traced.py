"""Pipeline stages of models potluck has no family adapter for, by tracing.

Any ``nn.Module`` that maps token ids ``[b, s]`` to logits (a tensor, a tuple
starting with them, or an object with ``.logits``) and keeps its blocks in
one ``nn.ModuleList`` is cut by ``torch.distributed.pipelining.pipeline``
(torch.export) before the first block of each virtual stage of the plan.

Tracing allocates nothing: real parameters and buffers are set aside, the model
is traced on fake tensors of the rank's device (so the forward's device-dependent
choices are that device's), and the real ones are put back into the stage modules
by name (the others return to the meta device and are initialized later, as usual).
Stage modules keep the model's parameter names. A second trace, cut before
the first and after the last block, tells which other parameters belong with
the embedding (used before the blocks) and which with the head (after them).
Tensor parallelism needs a family adapter and is refused for traced models.
"""

from __future__ import annotations

import operator
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.pipelining import SplitPoint, pipeline

from potluck.errors import ConfigError
from potluck.model.derived import largest_block_list
from potluck.placement import EMBED, HEAD, TIED, block_unit
from potluck.runtime.layout import Layout

_CALL_SUFFIX = re.compile(r"@\d+(?=\.|$)")


def find_blocks(model: nn.Module, num_layers: int) -> str:
    """The path of the ``nn.ModuleList`` that holds the model's ``num_layers`` blocks."""
    found = largest_block_list(model, num_layers)
    if found is None:
        raise ConfigError(
            f"{type(model).__name__} has no nn.ModuleList of {num_layers} blocks (the plan's "
            "layer count); keep the blocks in one ModuleList or plan for the right model"
        )
    return found[0]


def virtual_stage_ranges(layout: Layout) -> list[tuple[int, int]]:
    """Layer ranges of this rank's pipeline, in virtual-stage order."""
    plan, role = layout.plan, layout.role
    stages = plan.pipelines[role.pipeline].stages
    return [stage.layer_ranges[chunk] for chunk in range(len(role.layer_ranges))
            for stage in stages]


def example_input(layout: Layout) -> torch.Tensor:
    """A meta micro-batch of token ids, shaped as this rank's pipeline feeds them."""
    plan = layout.plan
    micro_batch = plan.pipelines[layout.role.pipeline].micro_batch_size
    return torch.zeros(micro_batch, plan.training.seq_len, dtype=torch.long, device="meta")


def _set_aside(model: nn.Module) -> dict[str, torch.Tensor]:
    """Replace real parameters and buffers by meta ones (tracing needs one device);
    return the real ones by name."""
    saved: dict[str, torch.Tensor] = {}
    for owner_name, owner in model.named_modules(remove_duplicate=False):
        for table in (owner._parameters, owner._buffers):
            for leaf, tensor in table.items():
                if tensor is not None and not tensor.is_meta:
                    saved[f"{owner_name}.{leaf}" if owner_name else leaf] = tensor
                    table[leaf] = _to_meta(tensor)
    return saved


def _swap_tensors(module: nn.Module, wanted: Callable[[torch.Tensor], bool],
                  make: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace each parameter and buffer ``wanted`` picks by ``make`` of it (a parameter
    stays a parameter, a tensor held under several names one tensor); the replaced ones by
    name."""
    replaced: dict[str, torch.Tensor] = {}
    made: dict[int, torch.Tensor] = {}
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for table in (owner._parameters, owner._buffers):
            for leaf, tensor in table.items():
                if tensor is None or not wanted(tensor):
                    continue
                replaced[f"{owner_name}.{leaf}" if owner_name else leaf] = tensor
                if id(tensor) not in made:
                    new = make(tensor)
                    made[id(tensor)] = (nn.Parameter(new, requires_grad=tensor.requires_grad)
                                        if isinstance(tensor, nn.Parameter) else new)
                table[leaf] = made[id(tensor)]
    return replaced


def _on_fake_device(model: nn.Module, mode: FakeTensorMode, device: torch.device
                    ) -> dict[str, torch.Tensor]:
    """Swap every meta parameter and buffer for a fake tensor on ``device`` (no memory), so
    the model traces as it runs there: its forward's device-dependent choices (a CPU-only
    dtype for a histogram, tensors made on the input's device) are those of ``device``, not
    the meta device's. Returns the meta tensors by name; shared ones stay shared."""

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)

    return _swap_tensors(model, lambda tensor: tensor.is_meta, fake)


def _fakes_to_meta(stage: nn.Module) -> None:
    """The fake parameters and buffers a traced stage kept, back on the meta device (they
    are materialized later, like any meta parameter); shared ones stay shared."""
    _swap_tensors(stage, lambda tensor: isinstance(tensor, FakeTensor),
                  lambda tensor: torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))


def _to_meta(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(tensor.to("meta"), requires_grad=tensor.requires_grad)
    return tensor.to("meta")


def _restore(module: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for table in (owner._parameters, owner._buffers):
            for leaf in list(table):
                name = _call_free(f"{owner_name}.{leaf}" if owner_name else leaf)
                if name in saved:
                    table[leaf] = saved[name]


def _call_free(name: str) -> str:
    """The model's own name of a stage's parameter or buffer: torch's split names the copy of
    a module the forward calls again ``path@1`` (OLMo 3's rotary module, once per kind of
    attention), holding the same tensors."""
    return _CALL_SUFFIX.sub("", name)


def _split(model: nn.Module, example: torch.Tensor, spec: dict[str, SplitPoint]) -> Any:
    """torch's tracing split, undoing the forward wrappers it leaves on the split modules."""
    saved = {name: model.get_submodule(name).__dict__.get("forward") for name in spec}
    try:
        return pipeline(model, mb_args=(example,), split_spec=spec)
    finally:
        for name, forward in saved.items():
            module = model.get_submodule(name)
            module.__dict__.pop("_orig_forward", None)
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward


def thread_values(pipe: Any) -> None:
    """Make every stage take exactly what the stage before it returns.

    torch's split hands a value to the stage that uses it, also past stages in between
    (rotary tables and masks made before the first block reach every block), but a
    pipeline stage receives only its predecessor's outputs. Each stage in between now also
    returns the values later stages need (its inputs passed on unchanged)."""
    calls = [node for node in pipe.split_gm.graph.nodes if node.op == "call_module"]
    producer = {}
    for index, call in enumerate(calls):
        producer[call] = index
        for user in call.users:
            if user.op == "call_function" and user.target is operator.getitem:
                producer[user] = index
    needs = [list(call.args) for call in calls]
    received: list[list[Any]] = [list(needs[0])]
    for index in range(len(calls) - 1):
        later = {value for stage_needs in needs[index + 1:] for value in stage_needs}
        produced = [value for value in producer if producer[value] <= index and value in later]
        own = [value for value in produced if producer[value] == index]
        received.append(own + [value for value in produced if producer[value] < index])
    for index, call in enumerate(calls):
        sends = received[index + 1] if index + 1 < len(calls) else None
        if needs[index] != received[index] or (sends is not None
                                              and sends != _outputs(call, producer)):
            _pass_on(pipe.get_stage_module(index), call, received[index], needs[index], sends)


def _contiguous_outputs(stage: nn.Module) -> None:
    """A traced stage's outputs in contiguous memory: what it hands on may be a view (an
    expanded mask, transposed positions), and a send needs contiguous tensors."""
    own_forward = stage.forward

    def forward(*args: Any) -> Any:
        out = own_forward(*args)
        if isinstance(out, tuple):
            return tuple(t.contiguous() if isinstance(t, torch.Tensor) else t for t in out)
        return out.contiguous() if isinstance(out, torch.Tensor) else out

    stage.forward = forward


def _outputs(call: Any, producer: dict[Any, int]) -> list[Any]:
    """A stage's own outputs, in the order it returns them."""
    items = sorted((user.args[1], user) for user in call.users
                   if user.op == "call_function" and user.target is operator.getitem)
    return [user for _, user in items] if items else [call]


def _pass_on(stage: nn.Module, call: Any, received: list[Any], needs: list[Any],
             sends: list[Any] | None) -> None:
    own_forward = stage.forward
    getitems = {user: user.args[1] for user in call.users
                if user.op == "call_function" and user.target is operator.getitem}

    def forward(*args: Any) -> Any:
        values = dict(zip(received, args, strict=True))
        out = own_forward(*(values[value] for value in needs))
        if sends is None:
            return out
        values[call] = out
        for node, position in getitems.items():
            values[node] = out[position]
        return tuple(values[value] for value in sends)

    stage.forward = forward


def _units(model: nn.Module, blocks_path: str, example: torch.Tensor) -> dict[str, str]:
    last = len(model.get_submodule(blocks_path)) - 1
    pipe = _split(model, example, {
        f"{blocks_path}.0": SplitPoint.BEGINNING, f"{blocks_path}.{last}": SplitPoint.END})
    units = {name: EMBED for name, _ in pipe.get_stage_module(0).named_parameters()}
    units.update({name: HEAD for name, _ in pipe.get_stage_module(2).named_parameters()})
    prefix = f"{blocks_path}."
    for name, _ in model.named_parameters():
        if name.startswith(prefix):
            units[name] = block_unit(int(name[len(prefix):].split(".", 1)[0]))
    return units


def _on_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.device) and value.type == "meta":
        return device
    if isinstance(value, tuple | list):
        return type(value)(_on_device(item, device) for item in value)
    return value


def retarget(stage: nn.Module, device: torch.device) -> None:
    """Point the tensors a traced stage creates at ``device``: tracing on meta tensors writes
    ``device=meta`` into every factory call the model's forward makes with an explicit device
    (positions, masks: OPT, GPT-NeoX), and metadata assertions that name meta (dropped)."""
    for module in stage.modules():
        graph = getattr(module, "graph", None)  # GraphModules and export's InterpreterModules
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in list(graph.nodes):
            if node.target is torch.ops.aten._assert_tensor_metadata.default:
                graph.erase_node(node)
                continue
            node.args = _on_device(node.args, device)
            node.kwargs = {key: _on_device(value, device) for key, value in node.kwargs.items()}
        if isinstance(module, torch.fx.GraphModule):
            module.recompile()


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Every other name of a parameter the model uses under several names (a head tied to
    the embedding) -> its first name: the copies start from one value and sync as one."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _check_constants(stage: nn.Module, model_name: str) -> None:
    """One line for a tensor the model's forward made on the meta device while traced (a
    constant whose values tracing on meta tensors cannot keep)."""
    for name, buffer in stage.named_buffers():
        if "lifted_tensor" in name and buffer.is_meta:
            raise ConfigError(
                f"{model_name}'s forward makes a tensor constant ({name}) that tracing on the "
                "meta device cannot keep, so potluck cannot cut it into pipeline stages; plan "
                "it with --pp 1 (data parallelism runs it whole)")


@contextmanager
def _untraceable(model_name: str) -> Iterator[None]:
    """One line for a model torch's tracing cannot capture or cut (a graph break, a module
    the forward calls from outside its parent: XLM's feed-forward)."""
    try:
        yield
    except (RuntimeError, ValueError, TypeError, AssertionError, NotImplementedError) as err:
        reason = next((line.strip() for line in str(err).splitlines() if line.strip()),
                      type(err).__name__)
        raise ConfigError(
            f"{model_name} cannot be traced into pipeline stages ({reason[:200]}); potluck runs "
            "a model it has no block adapter for only through tracing, so it cannot train it"
        ) from None


def _tie_within(stage: nn.Module, aliases: dict[str, str]) -> None:
    """A stage that holds a tied parameter under both names (the traced first stage keeps
    the head's name too) holds one parameter, as the model did."""
    params = dict(stage.named_parameters(remove_duplicate=False))
    for alias, canonical in aliases.items():
        if alias in params and canonical in params:
            owner, _, leaf = alias.rpartition(".")
            setattr(stage.get_submodule(owner) if owner else stage, leaf, params[canonical])


def trace_stages(model: nn.Module, layout: Layout, blocks_path: str, device: torch.device
                 ) -> tuple[list[nn.Module], dict[str, str], dict[str, str]]:
    """This rank's virtual stages of ``model``, cut at the plan's layer bounds, for
    ``device``, the gradient-sync unit of every parameter name (a tied embedding and head:
    ``TIED``) and the aliases of tied parameters (:func:`tied_aliases`)."""
    role = layout.role
    aliases = tied_aliases(model)
    tied = {*aliases, *aliases.values()}
    saved = _set_aside(model)
    fake_mode = FakeTensorMode()
    metas = _on_fake_device(model, fake_mode, device)
    shape = example_input(layout).shape
    with fake_mode:
        example = torch.zeros(shape, dtype=torch.long, device=device)
    try:
        with fake_mode, warnings.catch_warnings(), _untraceable(type(model).__name__):
            # torch's own copy of the module reads fake tensors' data pointers (harmless)
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            units = _units(model, blocks_path, example)
            if role.num_virtual_stages == 1:
                stages = [model]
            else:
                ranges = virtual_stage_ranges(layout)
                spec = {f"{blocks_path}.{start}": SplitPoint.BEGINNING for start, _ in ranges[1:]}
                pipe = _split(model, example, spec)
                thread_values(pipe)
                stages = [pipe.get_stage_module(index) for index in role.virtual_stage_ids]
                for stage in stages:
                    _contiguous_outputs(stage)
    finally:
        _restore(model, {**metas, **saved})
    for stage in stages:
        _restore(stage, saved)
        _fakes_to_meta(stage)
        retarget(stage, device)
        _tie_within(stage, aliases)
        _check_constants(stage, type(model).__name__)
    units.update({name: TIED for name in tied})
    return stages, units, aliases
