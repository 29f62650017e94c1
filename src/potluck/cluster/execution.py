"""How the training code executes a step: the :class:`Execution` traits, their named presets,
and the ``execution:`` section of a cluster file (or a file of its own) that chooses them.

A cluster file may say which framework will train on it::

    execution:
      preset: megatron-lm      # start from a named preset (default: potluck)
      overlap_grad_reduce: false   # any trait, overriding the preset's

``potluck plan|train|cost --execution NAME|FILE`` overrides the section (a preset name, or
a YAML file with the same keys). The chosen traits land in the plan's
``training.execution``; the cost model reads them there. The presets, and where each of
their figures comes from, are documented in ``docs/execution.md``.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import NonNegativeFloat, PositiveInt

from potluck.errors import ConfigError
from potluck.units import non_negative_number, parse_duration_s
from potluck.yamlio import Fields, load_yaml


class Placement(str, Enum):
    """Who decides which devices run which stage, and how the layers are split.

    ``rank-order`` is how Megatron-LM and DeepSpeed place ranks: over the devices in
    launch order (the cluster file's node groups in order, their machines in order, each
    machine's GPUs in order), tensor-parallel rank fastest, then data-parallel, then
    pipeline, so that replica ``d`` of stage ``s`` holds ranks ``(s * dp + d) * tp`` to
    ``+ tp`` (Megatron-LM ``megatron/core/parallel_state.initialize_model_parallel``, order
    ``tp-dp-pp``; DeepSpeed ``PipeModelDataParallelTopology``, axes ``pipe, data, model``,
    row-major); blocks split evenly over the stages, the first ``layers % pp`` stages one
    block more (DeepSpeed ``runtime/utils.partition_uniform``; Megatron-LM requires the
    division to be exact), and the batch evenly over the replicas.
    """

    PLANNED = "planned"  # potluck chooses devices per stage and splits layers by speed
    RANK_ORDER = "rank-order"  # Megatron-LM / DeepSpeed rank order, even layer split


class TiedGradSync(str, Enum):
    """How the gradient of a tied embedding (held by the first and the last stage) is summed.

    ``holders`` is potluck's runtime (:mod:`potluck.runtime.grads.buckets`): the tied
    weight is a bucket of its own, all-reduced over every stage that holds it, in every
    pipeline at once, launched with the stages' other buckets (the last one, as the
    embedding's gradient is the last a backward pass completes). ``pipeline-ends`` is
    Megatron-LM and DeepSpeed: each stage's data-parallel reduction includes its copy of the
    weight, and the first and the last stage of each pipeline sum theirs in a separate
    collective, one phase after the other: Megatron-LM after the data-parallel reduction
    (``finalize_model_grads``: ``finish_grad_sync``, then ``_allreduce_embedding_grads``),
    DeepSpeed before it (``TrainSchedule``: ``ReduceTiedGrads``, ``ReduceGrads``,
    ``OptimizerStep``). Priced as Megatron-LM's order: DeepSpeed's pipeline engine never
    overlaps its reduction with the backward pass, and then both orders take the same time.
    """

    HOLDERS = "holders"
    PIPELINE_ENDS = "pipeline-ends"


@dataclass(frozen=True)
class Execution:
    """How the training code executes a step, as far as time and memory depend on it.

    The defaults describe potluck's runtime: Hugging Face models in PyTorch eager mode
    with SDPA (flash) attention, 16-bit weights with FP32 masters and gradients summed over
    micro-batches in FP32 (on GPU ranks computing in 16 bits; CPU ranks train in FP32),
    gradient reduction in 16 bits overlapped with the backward pass. Other settings let the cost model
    describe other frameworks (e.g. Megatron-LM of 2021: fused kernels, attention scores
    in memory, 16-bit weights with FP32 master copies, FP32 gradient all-reduce after the
    backward pass) when comparing with their published runs.
    """

    fused_kernels: bool = False  # Megatron/TE-style fused norms, rotary and activations
    flash_attention: bool = True  # FlashAttention/SDPA kernels (False: scores in memory)
    overlap_grad_reduce: bool = True  # DP all-reduce overlaps the last backward pass
    overlap_p2p: bool = True  # pipeline sends and receives overlap compute
    fp32_params: bool = False  # FP32 weights under 16-bit autocast (False: 16-bit + FP32 master)
    # 16-bit weights' gradients summed over micro-batches in an FP32 buffer held instead of
    # the 16-bit .grad (Megatron-LM's main_grad; potluck's runtime); False: in the 16-bit
    # .grad itself (DeepSpeed's fp16 engine). Only 16-bit weights (fp32_params False or an
    # offloaded optimizer) have such gradients.
    fp32_main_grads: bool = True
    grad_reduce_bytes: PositiveInt = 2  # bytes per gradient element on the wire
    micro_batch_overhead_s: NonNegativeFloat = 0.0  # host time per micro-batch per stage (scheduler, Python)
    step_overhead_s: NonNegativeFloat = 0.0  # host time per iteration (optimizer launch, zero_grad, logging)
    # memory traffic per parameter and micro-batch to add its weight gradient into the
    # accumulation buffer, outside the GEMMs: the FP32 sum of a 16-bit gradient (read 2,
    # read and write the sum 4 + 4: runtime/grads/fp32_accumulation.py, as Megatron-LM's
    # main_grad hook); 18 for autocast's FP32 .grad (cast the 16-bit gradient: read 2,
    # write 4; AccumulateGrad's add: read 4 + 4, write 4)
    grad_accumulation_bytes: NonNegativeFloat = 10.0
    # host time to issue one block's forward (twice that for its backward), a floor under the
    # block's GPU time: potluck's eager PyTorch, 24 kernels x 8 us (planner.compute)
    block_host_s: NonNegativeFloat = 192e-6
    # activation swaps stream on a side stream under compute, prefetched (potluck's runtime);
    # False: copies on the compute stream that block it, as torch.autograd.graph.save_on_cpu
    overlap_swap: bool = True
    placement: Placement = Placement.PLANNED  # who places ranks and splits layers (Placement)
    tied_grad_sync: TiedGradSync = TiedGradSync.HOLDERS  # a tied embedding's sum (TiedGradSync)
    # Communication scheduling (Oases, TriRace; docs/execution.md). None: the search uses each
    # where it pays and records its choice in the plan (Plan.comm, Stage.comm); a value forces
    # it on or off for every plan made with these traits.
    tp_overlap_chunks: PositiveInt | None = None  # sub-batches per micro-batch on TP stages (1: off)
    recompute_keeps_comm: bool | None = None  # recomputation keeps its collectives' results
    split_p2p_channels: bool | None = None  # pipeline activations and gradients on two channels
    dp_priority_schedule: bool | None = None  # per-stage optimizer and ZeRO gathers overlap the next step
    sparse_embedding_grads: bool | None = None  # only touched embedding rows are reduced
    # torch.compile of each block and of the loss (runtime/parallel/compile.py). None (auto):
    # on GPU ranks, where fused kernels and fewer launches pay for the compile, off on CPU
    # ranks (tens of seconds of inductor per run); True also compiles on CPU ranks.
    compile: bool | None = None
    # the loss is one fused kernel over the 16-bit logits (flash-attn's CrossEntropyLoss, as
    # llm-foundry's MPT runs it): it reads them once in the forward and once more in the
    # backward to write their gradient; False: eager PyTorch, FP32 log-softmax and NLL
    fused_loss: bool = False
    # ZeRO-3: the embedding, final norm and output layer are one unit, the root (FSDP1's
    # root FlatParameter, torchtitan's fully_shard(model)), whose weights stay gathered and
    # whose full-size gradient is held from the start of the forward to the end of the
    # backward; False: each is a unit of its own, gathered around its use (potluck's runtime)
    zero3_root_unit: bool = False


DEFAULT_PRESET = "potluck"
AUTO_TRAITS = ("compile",)  # auto, true or false, decided by the runtime per rank
COMM_TRAITS = ("tp_overlap_chunks", "recompute_keeps_comm", "split_p2p_channels",
               "dp_priority_schedule", "sparse_embedding_grads")
# the frameworks potluck describes run none of the communication scheduling methods
COMM_OFF: dict[str, Any] = {"tp_overlap_chunks": 1, "recompute_keeps_comm": False,
                            "split_p2p_channels": False, "dp_priority_schedule": False,
                            "sparse_embedding_grads": False}

PRESETS: dict[str, Execution] = {
    # potluck's own runtime (docs/runtime.md): the Execution defaults.
    "potluck": Execution(),
    # Megatron-LM / Megatron-Core today (github.com/NVIDIA/Megatron-LM, main of 2026-08,
    # megatron/training/arguments.py and megatron/core/transformer/transformer_config.py).
    "megatron-lm": Execution(
        # Fusions are on unless turned off (--no-masked-softmax-fusion, --no-bias-gelu-fusion,
        # --no-bias-dropout-fusion, --no-rope-fusion, --no-gradient-accumulation-fusion), and
        # transformer_impl defaults to Transformer Engine (fused LayerNorm+Linear).
        fused_kernels=True,
        # attention_backend defaults to `auto`: Transformer Engine picks flash/fused attention.
        flash_attention=True,
        # --overlap-grad-reduce: off by default, passed by Megatron's own recipes
        # (examples/llama/train_llama3_8b_h100_fp8.sh, with --use-distributed-optimizer).
        overlap_grad_reduce=True,
        # On by default (--no-overlap-p2p-communication turns it off), but arguments.py
        # applies it to the interleaved schedule only; plain 1F1B sends block.
        overlap_p2p=True,
        # --bf16 sets params_dtype to bf16; the optimizer keeps FP32 main params
        # (--main-params-dtype fp32, the default).
        fp32_params=False,
        # With --bf16, accumulate_allreduce_grads_in_fp32 is switched on unless
        # --grad-reduce-in-bf16 is given (--main-grads-dtype fp32, the default).
        grad_reduce_bytes=4,
        # Gradients accumulate into the FP32 main_grad buffer (read the 16-bit gradient, read
        # and write main_grad: formulas.grad_accumulation_time_s); gradient_accumulation_fusion
        # (on by default) does that add inside the weight-gradient GEMM.
        grad_accumulation_bytes=10.0,
        # Ranks in tp-dp-pp order, even layer split (parallel_state.initialize_model_parallel);
        # the tied embedding summed by the first and last stage after the data-parallel
        # reduction (finalize_model_grads: finish_grad_sync, then _allreduce_embedding_grads).
        placement=Placement.RANK_ORDER, tied_grad_sync=TiedGradSync.PIPELINE_ENDS,
        # --batch-p2p-comm (the default) sends activations and receives gradients in one batched
        # call per stage pair; no sub-batch TP overlap (its --tp-comm-overlap pipelines GEMM
        # chunks with Transformer Engine's userbuffers instead), no sparse embedding gradients.
        # Its speed comes from Transformer Engine's kernels, not torch.compile.
        compile=False, **COMM_OFF,
    ),
    # Megatron-LM as in Narayanan et al., SC'21 (arXiv:2104.04473): commit a2fdcdf of
    # 2021-11-10. Fused kernels (§4.2 of the paper: bias+GeLU, bias+dropout+add, scale+mask+
    # softmax); attention scores in memory (FlashAttention came in 2022, arXiv:2205.14135);
    # megatron/training.py all-reduces gradients after forward_backward_func returns;
    # megatron/p2p_communication.py waits on every batch_isend_irecv request and then
    # torch.cuda.synchronize() (blocking sends); Float16Module weights with FP32 master
    # copies in Float16OptimizerWithFloat16Params; --accumulate-allreduce-grads-in-fp32
    # (forced on for bf16 in megatron/arguments.py); megatron/model/distributed.py's hook adds
    # each 16-bit gradient into the FP32 main_grad buffer (10 bytes per parameter).
    "megatron-lm-2021": Execution(
        fused_kernels=True, flash_attention=False, overlap_grad_reduce=False,
        overlap_p2p=False, fp32_params=False, grad_reduce_bytes=4, grad_accumulation_bytes=10.0,
        placement=Placement.RANK_ORDER, tied_grad_sync=TiedGradSync.PIPELINE_ENDS,
        compile=False, **COMM_OFF,
    ),
    # DeepSpeed's pipeline engine (deepspeed.pipe.PipelineModule, as in AMP/Metis-era runs of
    # 2021-2022) with fp16 and plain PyTorch layers (github.com/microsoft/DeepSpeed,
    # deepspeed/runtime/pipe/): no fused transformer kernels and no FlashAttention in the
    # model code of that era; schedule.py's TrainSchedule issues ReduceGrads after the last
    # micro-batch's backward pass (engine._exec_reduce_grads), so the all-reduce does not
    # overlap it; p2p.send asserts async_op=False (blocking dist.send); the fp16 optimizer
    # keeps 16-bit weights and FP32 master copies; engine.communication_data_type defaults
    # to fp16 when fp16 is enabled (config key `communication_data_type`, default None).
    "deepspeed": Execution(
        fused_kernels=False, flash_attention=False, overlap_grad_reduce=False,
        overlap_p2p=False, fp32_params=False, fp32_main_grads=False, grad_reduce_bytes=2,
        # AccumulateGrad on the 16-bit .grad (read 2 + 2, write 2); PipeModelDataParallelTopology
        # places ranks pipe-data-model (rank order); ReduceTiedGrads sums the tied embedding of
        # the first and last stage in its own step.
        grad_accumulation_bytes=6.0, placement=Placement.RANK_ORDER,
        tied_grad_sync=TiedGradSync.PIPELINE_ENDS, compile=False, **COMM_OFF,
    ),
    # PyTorch FSDP (FSDP1, FULL_SHARD) as Composer runs llm-foundry's MPT recipes: the runs of
    # llm-foundry's throughput tables (mosaicml/llm-foundry scripts/train/benchmarking/, yamls
    # scripts/train/yamls/pretrain/mpt-*.yaml; composer/trainer/mosaic_fsdp.py of Composer
    # 0.14-0.16). The layout is ZeRO-3 (`--zero 3`): every MPTBlock an FSDP unit with its own
    # FlatParameter (MPTModel.fsdp_wrap_fn), the rest in the root's.
    "fsdp": Execution(
        # MPT's blocks: LPLayerNorm is one F.layer_norm kernel in 16 bits with autocast off
        # (llmfoundry/models/layers/norm.py, norm_type low_precision_layernorm, which
        # submit_benchmarks.py sets), the MLP one nn.GELU(approximate='none') kernel
        # (layers/blocks.py MPTMLP), biases in the GEMMs' addmm: one read and one write per norm
        # and activation, as fused_kernels counts them.
        fused_kernels=True,
        # attn_config.attn_impl: triton (the yamls and submit_benchmarks.py's --attn_impl
        # default): FlashAttention in Triton (layers/flash_attn_triton.py), no scores in memory.
        flash_attention=True,
        # each unit's post-backward hook reduce-scatters its gradient while the backward pass
        # goes on; Composer runs every micro-batch's reduction (its ddp_sync_context applies
        # no_sync to DDP only).
        overlap_grad_reduce=True,
        # FSDP shards the module's FP32 parameters and MixedPrecision casts them to
        # param_dtype (bf16) as it gathers a unit; precision amp_bf16 autocasts the rest.
        fp32_params=True,
        # mixed_precision: PURE in the MPT yamls (param, reduce and buffer dtype bf16:
        # get_mixed_precision in Composer's mosaic_fsdp.py); DEFAULT reduces in FP32 from
        # Composer 0.16.4 (commit d745fcb, "patch default": reduce_dtype = torch.float32).
        grad_reduce_bytes=2,
        # the loss: flash_attn.losses.cross_entropy.CrossEntropyLoss (ComposerMPTCausalLM's
        # loss_fn default, fused_crossentropy; xentropy-cuda-lib in setup.py)
        fused_loss=True,
        # the embedding (wte, wpe) and final norm are the root FSDP module's FlatParameter;
        # FSDP1 does not reshard the root after forward (the tied wte is the output layer)
        zero3_root_unit=True,
        # autocast's FP32 .grad where nothing is sharded; under ZeRO-3 the cost model charges
        # the shard's sum instead (formulas.zero3_grad_accumulation_bytes)
        grad_accumulation_bytes=18.0,
        # torch 1.13 (the 40 GB table) and 2.1 (the 80 GB table's 2023-10 rows): no compile
        compile=False, **COMM_OFF,
    ),
    # torchtitan (pytorch/torchtitan at 9dec370, 2024-12-26: the commit of its published Llama
    # 3.1 performance, benchmarks/llama3_h100_202412_torchtitan.md), train_configs/llama3_*.toml
    # and torchtitan/parallelisms/parallelize_llama.py. ZeRO-3 is FSDP2: fully_shard on each
    # TransformerBlock, then on the whole model (apply_fsdp).
    "torchtitan": Execution(
        # [training] compile = false in the Llama 3 configs: eager RMSNorm (norm_type rmsnorm),
        # rotary and SwiGLU; compile = true compiles each block (apply_compile) and fuses them:
        # override fused_kernels and compile together for such runs.
        fused_kernels=False,
        # F.scaled_dot_product_attention(is_causal=True): the flash kernel.
        flash_attention=True,
        # FSDP2 reduce-scatters each block's gradient in its post-backward.
        overlap_grad_reduce=True,
        # FP32 parameters sharded; MixedPrecisionPolicy(param_dtype=bfloat16) gathers them in
        # bf16 (--training.mixed_precision_param default bfloat16)
        fp32_params=True,
        # --training.mixed_precision_reduce default (and only choice) float32
        grad_reduce_bytes=4,
        grad_accumulation_bytes=18.0,
        # train.py's loss_fn: cross_entropy(pred.flatten(0, 1).float(), labels), eager (its
        # torch.compile is commented out)
        fused_loss=False,
        # fully_shard(model) makes tok_embeddings, norm and output the root unit, gathered
        # through the forward (reshard_after_forward=not pp_enabled) and again for the backward
        zero3_root_unit=True,
        compile=False, **COMM_OFF,
    ),
}

PRESET_SUMMARIES = {
    "potluck": "potluck's runtime: eager PyTorch, SDPA attention, 16-bit weights with FP32 "
               "masters and gradient sums, 16-bit gradient reduction overlapped with the "
               "backward pass",
    "megatron-lm": "Megatron-LM today: fused kernels, flash attention, 16-bit weights with "
                   "FP32 main params, FP32 gradient reduction overlapped, overlapped sends",
    "megatron-lm-2021": "Megatron-LM of SC'21: fused kernels, attention scores in memory, "
                        "FP32 gradient all-reduce after the backward pass, blocking sends",
    "deepspeed": "DeepSpeed pipeline engine, fp16: no fused kernels, scores in memory, "
                 "fp16 gradient all-reduce after the backward pass, blocking sends",
    "fsdp": "PyTorch FSDP (FSDP1, FULL_SHARD) as Composer runs llm-foundry's MPT: one-kernel "
            "norms and GELU, Triton flash attention, fused cross-entropy, FP32 shards gathered "
            "in bf16, bf16 reduce-scatter (mixed_precision PURE), the root unit gathered "
            "through the step",
    "torchtitan": "torchtitan (FSDP2): eager Llama blocks, SDPA flash attention, FP32 shards "
                  "gathered in bf16, FP32 reduce-scatter, eager FP32 cross-entropy, the root "
                  "unit (embedding, norm, output) gathered for each pass",
}

TRAIT_NAMES = tuple(f.name for f in fields(Execution))
_KEYS = ("preset", *TRAIT_NAMES)


def preset(name: str) -> Execution:
    """The traits of the preset ``name`` (one line naming the presets if unknown)."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        tip = f"did you mean {close[0]!r}?" if close else f"presets: {', '.join(PRESETS)}"
        raise ConfigError(f"unknown execution preset {name!r}; {tip}")
    return PRESETS[name]


def parse_execution(data: Any, label: str, where: str = "execution", line: int = 0) -> Execution:
    """Read an ``execution`` mapping: ``preset`` (default potluck), then traits overriding it."""
    section = Fields(data, label, where, line)
    section.check_keys(_KEYS)
    base = section.get("preset", _preset_name, DEFAULT_PRESET)
    try:
        traits = preset(base)
    except ConfigError as err:
        raise section.error("preset", str(err)) from None
    overrides = {name: section.get(name, _converter(name)) for name in TRAIT_NAMES
                 if section.has(name)}
    return replace(traits, **overrides)


def load_execution(path: str | Path) -> Execution:
    """A YAML file with the keys of a cluster file's ``execution:`` section."""
    return parse_execution(load_yaml(path, "execution file"), str(path))


def choose_execution(flag: str | None, from_cluster: Execution | None = None) -> Execution:
    """``--execution`` (a preset name or a YAML file), else the cluster file's section,
    else potluck's runtime."""
    if flag is None:
        return from_cluster if from_cluster is not None else PRESETS[DEFAULT_PRESET]
    if flag in PRESETS:
        return PRESETS[flag]
    if Path(flag).suffix in (".yaml", ".yml") or Path(flag).is_file():
        return load_execution(flag)
    close = difflib.get_close_matches(flag, PRESETS, n=1)
    tip = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(f"--execution {flag!r} is neither a preset nor a file; {tip}"
                      f"give one of {', '.join(PRESETS)} or a YAML file of traits")


def placement_text(execution: Execution) -> str:
    """Who places the ranks and splits the layers, in words for a plan's reader."""
    if execution.placement is Placement.PLANNED:
        return "planned: devices chosen per stage, layers split by speed (potluck's runtime)"
    name = describe(execution).split(" ")[0]
    framework = "DeepSpeed" if name.startswith("deepspeed") else "Megatron-LM"
    return (f"rank order, even layer split, as {framework} launches (tensor-parallel ranks "
            "fastest, then data, then pipeline)")


def describe(execution: Execution) -> str:
    """The nearest preset's name and the traits that differ from it:
    ``megatron-lm``, ``megatron-lm-2021 + overlap_p2p=true``."""
    name = min(PRESETS, key=lambda n: len(differences(PRESETS[n], execution)))
    changed = differences(PRESETS[name], execution)
    if not changed:
        return name
    return f"{name} + {traits_text(execution, changed)}"


def traits_text(execution: Execution, names: list[str]) -> str:
    """``fused_kernels=true, grad_reduce_bytes=4``: the named traits as a cluster file
    writes them."""
    return ", ".join(f"{name}={_text(getattr(execution, name))}" for name in names)


def differences(base: Execution, execution: Execution) -> list[str]:
    """The traits of ``execution`` that differ from ``base``, in field order."""
    return [name for name in TRAIT_NAMES if getattr(base, name) != getattr(execution, name)]


def _text(value: Any) -> str:
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return str(value.value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _preset_name(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"must be a preset name ({', '.join(PRESETS)}), not {value!r}")
    return value.strip()


def _converter(name: str):
    """How a trait is read, by its name and the type of its default: true/false, 2 or 4
    bytes, a duration for ``*_s`` (bare numbers are seconds), another number, or an enum's
    value."""
    default = getattr(Execution(), name)
    if name == "tp_overlap_chunks":
        return _chunks
    if name in COMM_TRAITS or name in AUTO_TRAITS:
        return _auto_boolean
    if isinstance(default, bool):
        return _boolean
    if name == "grad_reduce_bytes":
        return _grad_bytes
    if name.endswith("_s"):
        return lambda value: parse_duration_s(value, name)
    if isinstance(default, int | float):
        return lambda value: non_negative_number(value, name)
    if isinstance(default, Enum):
        return lambda value: _enum(type(default), value)
    return type(default)


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"must be true or false, not {value!r}")
    return value


def _auto_boolean(value: Any) -> bool | None:
    """A communication trait (``auto``: the search decides where it pays) or ``compile``
    (``auto``: the runtime compiles on GPU ranks), true or false."""
    if value == "auto":
        return None
    if not isinstance(value, bool):
        raise ConfigError(f"must be auto, true or false, not {value!r}")
    return value


def _chunks(value: Any) -> int | None:
    """``tp_overlap_chunks``: ``auto`` (the search decides) or a count of sub-batches."""
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 8:
        raise ConfigError(f"must be auto or a number of sub-batches from 1 (off) to 8, "
                          f"not {value!r}")
    return value


def _grad_bytes(value: Any) -> int:
    if isinstance(value, bool) or value not in (2, 4):
        raise ConfigError(f"must be 2 (16-bit gradients on the wire) or 4 (FP32), not {value!r}")
    return int(value)


def _enum(kind: type[Enum], value: Any) -> Enum:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(str(member.value) for member in kind)
        raise ConfigError(f"must be one of {allowed}, not {value!r}") from None
