"""Compute time of a transformer's pieces on one device: blocks, attention and the head.

A block's forward is its GEMMs at their shapes (QKV and output projections, the MLP's
up/gate and down projections; ``b*s`` rows, tensor parallelism dividing the columns of
column-parallel and the inner dimension of row-parallel ones), each priced by
:mod:`potluck.planner.gemm` (the measured GEMM ceiling, tiles and waves over the SMs, the
roofline), its attention core (FlashAttention-2 at the published efficiencies of
:func:`potluck.planner.gemm.flash_attention_s`, or materialized scores: two batched GEMMs
and a softmax over the ``b*a*s^2`` scores) and its element-wise
traffic, op by op (eager PyTorch, or fused kernels); the backward is twice
the GEMMs and the element-wise traffic plus the attention's backward, and
recomputation adds the forward again. The host's time to issue a block's
kernels (``Execution.block_host_s``; potluck's eager PyTorch: 24 kernels x 8 us)
is a floor under its forward, twice that under its backward: a block whose GPU
work is shorter runs at the host's pace. The head is the output projection's GEMMs and
the loss's memory traffic over the logits, eager or one fused kernel
(``Execution.fused_loss``: :func:`potluck.model.counts.loss_traffic_bytes_per_logit`).
No communication: the cost model (:mod:`potluck.planner.cost`) adds tensor-parallel
collectives and transfers.
"""

from __future__ import annotations

from dataclasses import dataclass

from potluck.cluster.catalog import DeviceType
from potluck.model import counts
from potluck.model.counts import Recompute
from potluck.model.spec import ModelSpec
from potluck.planner import formulas, gemm
from potluck.planner.gemm import achievable_flops, effective_dtype
from potluck.plans import DType, Execution

OPS_PER_BLOCK_FORWARD = 24  # eager kernels in one block's forward (norms, GEMMs, rotary, ...)
# A mixture-of-experts MLP issues 25 aten ops where a dense SwiGLU MLP issues 8 (router GEMM,
# softmax, top-k, sort, index, histogram, cumsum, two grouped GEMMs, scatter, sum; counted
# on Qwen3-MoE and Mixtral blocks of transformers 5.24 on CPU, views excluded): 17 more.
MOE_EXTRA_OPS = 17
# The explicit TP executor issues a block's two parts apart (its attention: norm, Q/K/V,
# rotary, attention, output projection, residual add; its MLP: norm, gate/up, activation,
# down, residual add): aten ops dispatched by a Hugging Face LlamaDecoderLayer's parts on CPU,
# views excluded, 22 and 12. Each part's host floor is its share of ``block_host_s``.
ATTENTION_KERNEL_SHARE = 22 / 34


@dataclass(frozen=True)
class BlockTimes:
    """Compute time of one transformer block for one micro-batch on one device (no comms)."""

    forward_s: float
    backward_s: float
    weight_grad_s: float


@dataclass(frozen=True)
class PartTimes:
    """A block's two parts, each issued by the host on its own: attention (norm to output
    projection) and MLP (norm to down projection), residual adds included."""

    attention: BlockTimes
    mlp: BlockTimes


class ComputeModel:
    """Compute times of one model's blocks and head at one sequence length, per device type."""

    def __init__(self, model: ModelSpec, seq_len: int, dtype: DType = DType.BF16,
                 execution: Execution = Execution()) -> None:
        self.model = model
        self.seq_len = seq_len
        self.dtype = dtype
        self.fused_kernels = execution.fused_kernels
        self.fused_loss = execution.fused_loss
        self.flash_attention = execution.flash_attention and model.sdpa
        self.block_host_s = execution.block_host_s * (
            (OPS_PER_BLOCK_FORWARD + MOE_EXTRA_OPS) / OPS_PER_BLOCK_FORWARD if model.is_moe else 1.0)
        # plain dicts, not lru_cache on bound methods: no reference cycle, so a finished
        # search's caches are freed at once instead of by a later full garbage collection
        self._blocks: dict[tuple, BlockTimes] = {}
        self._heads: dict[tuple, BlockTimes] = {}

    def element_bytes(self, device_type: DeviceType) -> int:
        """Bytes per activation element in the dtype ``device_type`` computes in."""
        return effective_dtype(device_type, self.dtype).bytes

    def achievable_flops(self, device_type: DeviceType) -> float:
        """FLOP/s large GEMMs reach on ``device_type`` in the dtype it computes in."""
        return achievable_flops(device_type, self.dtype)

    def element_scale(self, device: DeviceType) -> float:
        """Element-wise traffic is counted in 16-bit elements; FP32 doubles it."""
        return self.element_bytes(device) / 2.0

    def block_times(self, device_type: DeviceType, tp: int, micro_batch: int,
                    recompute: Recompute, ep: int = 1) -> BlockTimes:
        """One block's forward and backward of one micro-batch, on ``tp`` devices of a type
        (its routed experts split over ``ep`` replicas: :func:`counts.block_gemms`)."""
        key = (device_type, tp, micro_batch, recompute, ep)
        if key not in self._blocks:
            self._blocks[key] = self._compute_block_times(*key)
        return self._blocks[key]

    def part_times(self, device_type: DeviceType, tp: int, micro_batch: int,
                   recompute: Recompute) -> PartTimes:
        """One block's attention and MLP parts for one (sub-)batch of ``micro_batch``
        sequences, as the explicit TP executor runs them: without sequence parallelism (the
        hidden stream's element-wise ops whole on every rank), recomputation per part."""
        key = (device_type, tp, micro_batch, recompute, "parts")
        if key not in self._blocks:
            self._blocks[key] = self._compute_part_times(device_type, tp, micro_batch, recompute)
        return self._blocks[key]

    def head_times(self, device_type: DeviceType, tp: int, micro_batch: int) -> BlockTimes:
        """The output projection and the loss of one micro-batch."""
        key = (device_type, tp, micro_batch)
        if key not in self._heads:
            self._heads[key] = self._compute_head_times(*key)
        return self._heads[key]

    def _compute_block_times(self, device: DeviceType, tp: int, b: int,
                             recompute: Recompute, ep: int) -> BlockTimes:
        m, s = self.model, self.seq_len
        gemms = self._block_gemms_s(device, tp, b, ep)
        attention = self._attention_s(device, tp, b)
        elementwise = (counts.block_elementwise_bytes(m, b, s, fused=self.fused_kernels) / tp
                       * self.element_scale(device))
        elementwise_s = formulas.roofline_time_s(
            0.0, elementwise, self.achievable_flops(device), device.memory_bandwidth_bytes_per_s
        )
        forward = gemms + attention.forward_s + elementwise_s
        backward = 2.0 * gemms + attention.backward_s + 2.0 * elementwise_s
        if recompute is Recompute.FULL:
            backward += forward
        elif recompute is Recompute.SELECTIVE:
            backward += self._selective_recompute_s(device, tp, b, attention)
        dispatch = self.block_host_s
        forward_total = max(forward, dispatch)
        backward_total = max(backward, 2.0 * dispatch)
        return BlockTimes(forward_total, backward_total, weight_grad_s=gemms)

    def _compute_part_times(self, device: DeviceType, tp: int, b: int,
                            recompute: Recompute) -> PartTimes:
        m, rows = self.model, b * self.seq_len
        traffic = counts.block_elementwise_parts(m, b, self.seq_len, fused=self.fused_kernels)
        attention = self._attention_s(device, tp, b)
        parts = []
        for part, hidden, sharded, core, share in (
                ("attention", traffic.attention_hidden, traffic.attention_sharded, attention,
                 ATTENTION_KERNEL_SHARE),
                ("mlp", traffic.mlp_hidden, traffic.mlp_sharded, BlockTimes(0.0, 0.0, 0.0),
                 1.0 - ATTENTION_KERNEL_SHARE)):
            gemms = sum(self._block_gemm_s(device, matmul, rows, tp)
                        for matmul in counts.block_gemms(m) if matmul.part == part)
            elementwise = self._elementwise_s(device, hidden + sharded / tp)
            forward = gemms + core.forward_s + elementwise
            backward = 2.0 * gemms + core.backward_s + 2.0 * elementwise
            if recompute is Recompute.FULL:
                backward += forward
            elif recompute is Recompute.SELECTIVE and core.forward_s:
                backward += self._selective_recompute_s(device, tp, b, core)
            dispatch = self.block_host_s * share
            parts.append(BlockTimes(max(forward, dispatch), max(backward, 2.0 * dispatch), gemms))
        return PartTimes(*parts)

    def _elementwise_s(self, device: DeviceType, num_bytes: float) -> float:
        return formulas.roofline_time_s(0.0, num_bytes * self.element_scale(device),
                                        self.achievable_flops(device),
                                        device.memory_bandwidth_bytes_per_s)

    def _selective_recompute_s(self, device: DeviceType, tp: int, b: int,
                               attention: BlockTimes) -> float:
        """What selective recomputation redoes in the backward pass. Fused (Megatron,
        Korthikanti et al. 2022): the attention core, which flash kernels recompute anyway.
        Eager (potluck's runtime checkpoints the whole attention module): the core and the
        Q/K/V and output projections."""
        if self.fused_kernels:
            return 0.0 if self.flash_attention else attention.forward_s
        rows = b * self.seq_len
        projections = sum(self._block_gemm_s(device, matmul, rows, tp)
                          for matmul in counts.block_gemms(self.model) if matmul.part == "attention")
        return attention.forward_s + projections

    def _attention_s(self, device: DeviceType, tp: int, b: int) -> BlockTimes:
        if self.flash_attention:
            return BlockTimes(*self._flash_attention_s(device, tp, b), 0.0)
        forward = self._materialized_attention_s(device, tp, b)
        return BlockTimes(forward, 2.0 * forward, 0.0)

    def _block_gemms_s(self, device: DeviceType, tp: int, b: int, ep: int = 1) -> float:
        rows = b * self.seq_len
        return sum(self._block_gemm_s(device, matmul, rows, tp)
                   for matmul in counts.block_gemms(self.model, ep))

    def _block_gemm_s(self, device: DeviceType, matmul: counts.Gemm, rows: int, tp: int) -> float:
        """One of a block's matmuls for ``rows`` tokens (routed experts: one grouped kernel)."""
        group_rows, inner, cols = matmul.shape(rows, tp)
        return gemm.matmul_time_s(device, self.dtype, group_rows, inner, cols, matmul.groups)

    def _gemm_s(self, device: DeviceType, rows: int, inner: int, cols: int) -> float:
        return gemm.matmul_time_s(device, self.dtype, rows, inner, cols)

    def _flash_attention_s(self, device: DeviceType, tp: int, b: int) -> tuple[float, float]:
        """FlashAttention's forward and backward: causal scores never leave the chip (half of
        them skipped); Q, K, V read, output written."""
        m, s = self.model, self.seq_len
        flops = counts.attention_core_forward_flops(m, b, s) * gemm.CAUSAL_FRACTION / tp
        traffic = (4 * s * b * m.q_size + 4 * s * b * m.kv_hidden_size) / tp
        traffic *= self.element_scale(device)
        keys_per_query = m.mean_keys_per_query(s) * gemm.CAUSAL_FRACTION
        return gemm.flash_attention_s(device, self.dtype, flops, traffic, keys_per_query)

    def _materialized_attention_s(self, device: DeviceType, tp: int, b: int) -> float:
        """Scores in memory (Megatron before FlashAttention, eager attention): two batched
        GEMMs over every head plus a fused scale-mask-softmax that reads and writes the
        ``b*a*s^2`` scores, and a dropout on them when the model has one (5 bytes each)."""
        m, s = self.model, self.seq_len
        heads = b * m.num_heads // tp
        scale = self.element_scale(device)
        scores = self._gemm_s(device, heads * s, m.head_dim, s)
        values = self._gemm_s(device, heads * s, s, m.head_dim)
        softmax_bytes = (4.0 + (5.0 if m.dropout else 0.0)) * heads * s * s * scale
        softmax = formulas.roofline_time_s(0.0, softmax_bytes, self.achievable_flops(device),
                                           device.memory_bandwidth_bytes_per_s)
        return scores + values + softmax

    def _compute_head_times(self, device: DeviceType, tp: int, b: int) -> BlockTimes:
        m = self.model
        rows = b * self.seq_len
        projection = self._gemm_s(device, rows, m.hidden_size, m.vocab_size // tp)
        forward_bytes, backward_bytes = counts.loss_traffic_bytes_per_logit(self.fused_loss)
        logits = rows * m.vocab_size / tp
        forward, backward = (formulas.roofline_time_s(0.0, logits * per_logit,
                                                      self.achievable_flops(device),
                                                      device.memory_bandwidth_bytes_per_s)
                             for per_logit in (forward_bytes, backward_bytes))
        return BlockTimes(projection + forward, 2.0 * projection + backward,
                          weight_grad_s=projection)
