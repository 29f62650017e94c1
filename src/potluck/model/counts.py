"""Per-layer parameters, FLOPs and activation bytes of a :class:`ModelSpec`.

The model is a list of layers: the embedding, ``num_layers`` identical blocks
and the head (final norm + output projection + loss). Counts follow

- parameters: count the matrices (Narayanan et al., SC'21, Eq. 2 for GPT;
  attention ``2h^2 + 2h*(h*k/a)`` and SwiGLU ``3*h*f`` for LLaMA-style blocks);
- FLOPs: 2 per multiply-add of every matmul plus ``4*b*s^2*h`` for attention
  scores and values per block, backward = 2 x forward (SC'21, Eq. 3). With
  ``ffn = 4h`` and no GQA this is exactly ``72*B*s*l*h^2*(1 + s/(6h) + V/(12lh))``;
- activations: Korthikanti et al. 2022, Table 2, generalized to GQA, SwiGLU,
  models without dropout, and sequence parallelism (every term divided by t), for
  fused (Megatron-style) execution; for eager PyTorch running Hugging Face blocks,
  tensor by tensor what autograd saves (``eager_*`` functions, measured).

``b`` is the micro-batch size in sequences, ``s`` the sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from potluck.model.spec import MlpKind, ModelSpec, NormKind


class Recompute(str, Enum):
    """Activation recomputation (Korthikanti et al. 2022)."""

    NONE = "none"
    SELECTIVE = "selective"  # recompute the attention core (softmax(QK^T)V)
    FULL = "full"  # keep only each block's input; redo the block's forward in backward


@dataclass(frozen=True)
class Gemm:
    """One matmul of a block: a ``[rows, inner] x [inner, cols]`` product run on
    ``rows_per_token`` rows per token (the top-k of routed experts, else 1). ``split`` is how
    tensor parallelism divides it: ``cols`` (column-parallel), ``inner`` (row-parallel) or
    ``none`` (replicated: a router). Routed experts are ``groups`` such products with their
    own weights, the rows shared evenly among them (uniform routing)."""

    inner: int
    cols: int
    part: str  # "attention" or "mlp"
    split: str
    rows_per_token: int = 1
    groups: int = 1

    def shape(self, rows: int, tp: int) -> tuple[int, int, int]:
        """(rows of one group, inner, cols) on one of ``tp`` ranks for ``rows`` tokens."""
        inner = self.inner // tp if self.split == "inner" else self.inner
        cols = self.cols // tp if self.split == "cols" else self.cols
        return max(1, -(-rows * self.rows_per_token // self.groups)), inner, cols

    @property
    def weights(self) -> int:
        """Weights one row multiplies (one group's)."""
        return self.inner * self.cols


def up_columns(m: ModelSpec, width: int) -> int:
    """Columns of the MLP's up projection(s) of ``width``: gate and up for SwiGLU."""
    return (2 if m.mlp is MlpKind.SWIGLU else 1) * width


@lru_cache(maxsize=256)
def block_gemms(m: ModelSpec, ep: int = 1) -> tuple[Gemm, ...]:
    """A block's matmuls: Q/K/V and output projections, then a dense MLP, or a router,
    ``experts_per_token`` routed experts and the shared expert of a mixture of experts
    (cached: the search prices them for every stage it tries). Under expert parallelism
    over ``ep`` replicas a device runs ``E/ep`` experts on the tokens all ``ep`` route to
    them: the same rows in all, ``ep`` times as many per expert."""
    h, q, kv, f = m.hidden_size, m.q_size, m.kv_hidden_size, m.ffn_hidden_size
    gemms = [Gemm(h, q + 2 * kv, "attention", "cols"), Gemm(q, h, "attention", "inner")]
    if not m.is_moe:
        return (*gemms, Gemm(h, up_columns(m, f), "mlp", "cols"), Gemm(f, h, "mlp", "inner"))
    k, experts = m.experts_per_token, m.num_experts
    gemms += [Gemm(h, experts, "mlp", "none"),
              Gemm(h, up_columns(m, f), "mlp", "cols", k, experts // ep),
              Gemm(f, h, "mlp", "inner", k, experts // ep)]
    if m.shared_ffn_size:
        shared = m.shared_ffn_size
        gemms += [Gemm(h, up_columns(m, shared), "mlp", "cols"), Gemm(shared, h, "mlp", "inner")]
    return tuple(gemms)


def attention_params(m: ModelSpec) -> int:
    h, q, kv = m.hidden_size, m.q_size, m.kv_hidden_size
    weights = 2 * h * q + 2 * h * kv
    bias = (q + 2 * kv if m.qkv_bias else 0) + (h if m.linear_bias else 0)
    return weights + bias


def _dense_mlp_params(m: ModelSpec, width: int) -> int:
    h = m.hidden_size
    bias = (up_columns(m, width) + h) if m.linear_bias else 0
    return up_columns(m, width) * h + width * h + bias


def mlp_params(m: ModelSpec) -> int:
    """The MLP: dense, or the router, every routed expert and the shared expert."""
    if not m.is_moe:
        return _dense_mlp_params(m, m.ffn_hidden_size)
    shared = _dense_mlp_params(m, m.shared_ffn_size) if m.shared_ffn_size else 0
    return (m.hidden_size * m.num_experts + m.num_experts * _dense_mlp_params(m, m.ffn_hidden_size)
            + shared)


def routed_expert_params(m: ModelSpec) -> int:
    """One block's routed experts (what expert parallelism splits); 0 for a dense model."""
    return m.num_experts * _dense_mlp_params(m, m.ffn_hidden_size) if m.is_moe else 0


def active_mlp_width(m: ModelSpec) -> int:
    """MLP width one token passes through: the dense width, or top-k experts and the shared."""
    if not m.is_moe:
        return m.ffn_hidden_size
    return m.experts_per_token * m.ffn_hidden_size + m.shared_ffn_size


def norm_params(m: ModelSpec) -> int:
    return 2 * m.hidden_size if m.norm is NormKind.LAYERNORM else m.hidden_size


def block_params(m: ModelSpec) -> int:
    if m.params is not None:
        return m.params.block
    return attention_params(m) + mlp_params(m) + 2 * norm_params(m)


def embedding_params(m: ModelSpec) -> int:
    if m.params is not None:
        return m.params.embedding
    positions = m.max_seq_len * m.hidden_size if m.learned_positions else 0
    return m.vocab_size * m.hidden_size + positions


def head_params(m: ModelSpec, separate_from_embedding: bool = False) -> int:
    """Final norm and output projection; a tied projection counts only when it
    lives on another device than the embedding (pipeline parallel keeps a copy)."""
    projection = m.params.projection if m.params is not None else m.vocab_size * m.hidden_size
    final_norm = m.params.final_norm if m.params is not None else norm_params(m)
    own = projection if (not m.tied_embeddings or separate_from_embedding) else 0
    return final_norm + own


def total_params(m: ModelSpec) -> int:
    return embedding_params(m) + m.num_layers * block_params(m) + head_params(m)


def active_params(m: ModelSpec) -> int:
    """Parameters one token uses: all but the routed experts it is not sent to."""
    if not m.is_moe:
        return total_params(m)
    idle = m.num_experts - m.experts_per_token
    return total_params(m) - m.num_layers * idle * _dense_mlp_params(m, m.ffn_hidden_size)


def block_matmul_params(m: ModelSpec) -> int:
    """Weights one token multiplies in a block (biases and norms excluded; for a mixture of
    experts only the router, its top-k experts and the shared expert)."""
    return sum(g.weights * g.rows_per_token for g in block_gemms(m))


def block_forward_flops(m: ModelSpec, b: int, s: int) -> float:
    """Model FLOPs of one block's forward for ``b`` sequences of ``s`` tokens: as counted on
    the model itself when the spec was derived from it, else from the formulas."""
    if m.block_flops is not None:
        flops = m.block_flops
        return b * s * (flops.matmul_per_token + m.mean_keys_per_query(s) * flops.scores_per_key)
    return 2.0 * b * s * block_matmul_params(m) + attention_core_forward_flops(m, b, s)


def attention_core_forward_flops(m: ModelSpec, b: int, s: int) -> float:
    """``QK^T`` and attention-times-values: ``2*b*s^2*h`` each (SC'21 counts the full square;
    ``h`` is the query width, ``s^2`` shortened to ``s*w`` in blocks with a window ``w``)."""
    return 4.0 * b * s * m.mean_keys_per_query(s) * m.q_size


def head_forward_flops(m: ModelSpec, b: int, s: int) -> float:
    return 2.0 * b * s * m.hidden_size * m.vocab_size


def model_flops_per_token(m: ModelSpec, s: int) -> float:
    """Training FLOPs (forward + backward, no recomputation) per token."""
    forward = m.num_layers * block_forward_flops(m, 1, s) + head_forward_flops(m, 1, s)
    return 3.0 * forward / s


@dataclass(frozen=True)
class ActivationTerms:
    """Activation bytes of one block as ``sbh`` and ``as^2b`` coefficients (16-bit)."""

    per_sbh: float
    per_as2b: float


def block_activation_terms(m: ModelSpec) -> ActivationTerms:
    """Korthikanti et al. 2022, Table 2, counted per tensor so GQA/SwiGLU/no-dropout fit.

    GPT with dropout and ffn = 4h gives the paper's 34 sbh + 5 as^2b exactly.
    """
    kv_ratio = m.kv_hidden_size / m.hidden_size
    q_ratio = m.q_size / m.hidden_size
    ffn_ratio = active_mlp_width(m) / m.hidden_size
    mask = 1.0 if m.dropout else 0.0
    # QKV input 2, Q 2, K and V 2 each scaled by kv/h, attention output-projection input 2,
    # dropout mask 1.
    attention = 2 + 2 * q_ratio + 4 * kv_ratio + 2 * q_ratio + mask
    # softmax output 2 (+ dropout mask 1 and dropout output 2 with dropout)
    scores = 2 + 3 * mask
    if m.mlp is MlpKind.SWIGLU:
        # input 2, gate output 2f, up output 2f, SiLU output 2f, down input 2f
        mlp = 2 + 8 * ffn_ratio + mask
    else:
        # fc1 input 2, GeLU input 2f, fc2 input 2f, dropout mask 1
        mlp = 2 + 4 * ffn_ratio + mask
    norms = 4.0
    return ActivationTerms(per_sbh=attention + mlp + norms, per_as2b=scores)


def block_activation_bytes(m: ModelSpec, b: int, s: int, tp: int, recompute: Recompute, *,
                           flash_attention: bool = False, fused: bool = False,
                           sequence_parallel: bool = True) -> float:
    """Bytes one block keeps for the backward pass per micro-batch, counted in 16-bit
    elements (the planner scales by the compute dtype's element size).

    ``fused=True`` is Megatron-style execution, Korthikanti et al.'s count
    (:func:`block_activation_terms`); ``fused=False`` is eager PyTorch running a Hugging
    Face block (:func:`eager_block_activation_elements`). FlashAttention keeps no ``s^2``
    scores (only the output and a log-sum-exp per row), which is what selective
    recomputation achieves for materialized attention. Full recomputation keeps the
    block's input only (torch's checkpoint saves it for the recomputation).

    With sequence parallelism (tp > 1, potluck's DTensor styles) every term is divided by
    ``t``. Without it (potluck's explicit TP executor, Megatron-LM before 2022) the tensors
    on the hidden stream are whole on every rank (Korthikanti et al., Sec. 4.2.1: ``10sbh``
    of the ``34sbh`` are not split): the norms' inputs and outputs (the Q/K/V and MLP
    inputs) and the residual dropout masks; and full recomputation checkpoints each part
    apart so that no collective is recomputed, keeping both parts' inputs whole.
    """
    sbh = s * b * m.hidden_size
    if recompute is Recompute.FULL:
        return 2.0 * sbh / tp if sequence_parallel or tp == 1 else 2.0 * 2.0 * sbh
    hidden, rest = _activation_split(m, b, s, recompute, flash_attention, fused)
    if sequence_parallel:
        return (hidden + rest) / tp
    return hidden + rest / tp


def _activation_split(m: ModelSpec, b: int, s: int, recompute: Recompute,
                      flash_attention: bool, fused: bool) -> tuple[float, float]:
    """A block's saved bytes (16-bit elements x 2) on the hidden stream and the rest."""
    sbh = s * b * m.hidden_size
    mask = 1.0 if m.dropout else 0.0
    if not fused:
        total = 2.0 * eager_block_activation_elements(m, b, s, recompute,
                                                      flash_attention=flash_attention)
        hidden = 2.0 * (2.0 * eager_norm_elements(m, b, s) + (sbh if m.dropout else 0.0))
        return hidden, total - hidden
    terms = block_activation_terms(m)
    keeps_scores = recompute is Recompute.NONE and not flash_attention
    scores = terms.per_as2b * m.num_heads * s * s * b if keeps_scores else 0.0
    hidden = (4.0 + 2.0 + 2.0 + 2.0 * mask) * sbh  # norm inputs, QKV and MLP inputs, masks
    return hidden, terms.per_sbh * sbh + scores - hidden


def eager_norm_elements(m: ModelSpec, b: int, s: int) -> float:
    """What one Hugging Face norm keeps, output included (it is the next matmul's input).

    RMSNorm (``LlamaRMSNorm``): its input (saved by ``pow`` and the scaling multiply), the
    normalized tensor (saved by the weight multiply), the output and the ``rsqrt`` per
    row. LayerNorm (``aten.native_layer_norm``): input, output, mean and rstd per row.
    """
    sbh, rows = s * b * m.hidden_size, s * b
    if m.norm is NormKind.RMSNORM:
        return 3.0 * sbh + rows
    return 2.0 * sbh + 2.0 * rows


def eager_attention_elements(m: ModelSpec, b: int, s: int, *, flash_attention: bool) -> float:
    """What a Hugging Face attention keeps, from Q/K/V on (its input is the norm's output).

    SDPA (``flash_attention``; torch's flash kernel): Q and K after rotary embedding, V,
    the output (also the output projection's input, one storage) and a log-sum-exp per
    head and row. GPT-2's fused ``c_attn`` instead keeps its whole QKV output (alive through
    the views of Q, K and V) and the output (training keeps no key/value cache). Eager attention (scores in
    memory): Q, K and V as ``matmul`` saves them (contiguous, K and V repeated to every
    head under GQA), the softmax output ``a*s^2*b`` and the output projection's input
    (a contiguous copy of the transposed heads). Rotary ``cos``/``sin`` are shared by all
    blocks (:func:`embedding_activation_bytes`).
    """
    sbq, sbkv = s * b * m.q_size, s * b * m.kv_hidden_size
    heads_rows = m.num_heads * s * b
    if not flash_attention:
        return 4.0 * sbq + heads_rows * s
    if m.family == "gpt2":
        return 4.0 * sbq + heads_rows
    return 2.0 * sbq + 2.0 * sbkv + heads_rows


def eager_mlp_elements(m: ModelSpec, b: int, s: int) -> float:
    """What a Hugging Face MLP keeps past its input (the norm's output).

    SwiGLU: the gate output (SiLU's input), the SiLU output and the up output (the
    multiply's inputs) and their product (the down projection's input): ``4*s*b*f``.
    GPT-2's ``gelu_new`` is eight element-wise ops that keep four tensors of the MLP width
    (its input, ``x^3``'s input product, the ``tanh`` output, ``1 + tanh``), plus its output
    (the down projection's input): ``5*s*b*f``.
    """
    sbf = s * b * active_mlp_width(m)
    return (4.0 if m.mlp is MlpKind.SWIGLU else 5.0) * sbf


def eager_block_activation_elements(m: ModelSpec, b: int, s: int, recompute: Recompute, *,
                                    flash_attention: bool = False) -> float:
    """Elements one eager Hugging Face block saves for backward (no tensor parallelism):
    two norms (the first one's input is the block's input, the second's the residual
    stream), the attention and the MLP, plus Korthikanti's dropout masks (one byte, half
    an element) and dropped-out scores when the model has dropout. Measured with
    ``saved_tensors_hooks`` on LLaMA and GPT-2 blocks in FP32 on CPU, deduplicated by
    storage, parameters excluded: every term above, exactly (tests/model/test_counts.py).
    Selective recomputation (potluck's: the whole attention module checkpointed) keeps
    the norms and the MLP only.
    """
    sbh, scores = s * b * m.hidden_size, m.num_heads * s * s * b
    attention = 0.0
    if recompute is not Recompute.SELECTIVE:
        attention = eager_attention_elements(m, b, s, flash_attention=flash_attention)
        if m.dropout and not flash_attention:
            attention += 1.5 * scores
    masks = 2 * 0.5 * sbh if m.dropout else 0.0
    return 2.0 * eager_norm_elements(m, b, s) + attention + eager_mlp_elements(m, b, s) + masks


def embedding_activation_bytes(m: ModelSpec, b: int, s: int, tp: int, *,
                               fused: bool = False) -> float:
    """What the embedding keeps for the first block, in 16-bit elements.

    ``fused=True`` (Korthikanti): the embedding output and its dropout mask. Eager
    (``fused=False``): the first block's norm already counts the embedding output as its
    input (:func:`eager_norm_elements`); left are the rotary ``cos`` and ``sin`` tables
    every block's rotary embedding saves (one storage shared by all blocks, ``s*d`` each)
    and, with dropout, the embedding dropout's mask (one byte per element) and output.
    """
    sbh = s * b * m.hidden_size
    if fused:
        return (2.0 + (1.0 if m.dropout else 0.0)) * sbh / tp
    rope = m.norm is NormKind.RMSNORM and not m.learned_positions
    rotary = 2.0 * 2.0 * s * m.head_dim if rope else 0.0
    return rotary + (3.0 * sbh / tp if m.dropout else 0.0)


def head_activation_bytes(m: ModelSpec, b: int, s: int, tp: int, *, fused: bool = False) -> float:
    """What the head keeps per micro-batch (vocab-parallel), in 16-bit elements.

    The logits (the last stage's output, which torch's pipeline schedule holds until the
    micro-batch's backward) and the loss's log-softmax output, one logit-sized tensor
    each (in FP32 on CPU ranks; on 16-bit devices the log-softmax output is FP32, as
    ``TokenLoss`` upcasts: 2 more bytes per logit, not counted here). Before them the
    final norm: ``fused=True`` its input and the projection's input (Korthikanti), eager
    what a Hugging Face norm keeps (:func:`eager_norm_elements`).
    """
    sbv = s * b * m.vocab_size
    norm = 4.0 * s * b * m.hidden_size if fused else 2.0 * eager_norm_elements(m, b, s)
    return (norm + 4.0 * sbv) / tp


# The loss's memory traffic per logit of a 16-bit model, (forward, backward) bytes. Eager
# PyTorch: FP32 logits through log-softmax and the NLL loss read and write about three times,
# 12 bytes in each pass. Fused (flash-attn's CrossEntropyLoss, csrc/xentropy): the forward
# reads the 16-bit logits once (2 bytes) and keeps a log-sum-exp per row; the backward reads
# them again and writes their gradient (4 bytes).
EAGER_LOSS_BYTES_PER_LOGIT = (12.0, 12.0)
FUSED_LOSS_BYTES_PER_LOGIT = (2.0, 4.0)


def loss_traffic_bytes_per_logit(fused: bool) -> tuple[float, float]:
    """Memory traffic of the cross-entropy per logit, forward and backward, in bytes."""
    return FUSED_LOSS_BYTES_PER_LOGIT if fused else EAGER_LOSS_BYTES_PER_LOGIT


def head_logits_bytes(m: ModelSpec, b: int, s: int, tp: int) -> float:
    """The logits alone (in 16-bit elements): what the head still holds once its own
    backward pass has run, while the last stage's blocks recompute."""
    return 2.0 * s * b * m.vocab_size / tp


@dataclass(frozen=True)
class ElementwiseBytes:
    """One block's non-matmul forward traffic in bytes, split by part and by tensor kind:
    ``*_hidden`` on the hidden stream (norms, residual adds, dropout: replicated on every
    TP rank without sequence parallelism, split by ``t`` with it) and ``*_sharded`` on the
    heads or the MLP width (rotary, the transpose, the activation: always split by ``t``)."""

    attention_hidden: float
    attention_sharded: float
    mlp_hidden: float
    mlp_sharded: float

    def total(self) -> float:
        return self.attention_hidden + self.attention_sharded + self.mlp_hidden + self.mlp_sharded


def block_elementwise_parts(m: ModelSpec, b: int, s: int, *, fused: bool = False
                            ) -> ElementwiseBytes:
    """Memory traffic of one block's non-matmul forward ops, in bytes, by part.

    Counted op by op as each reads its inputs and writes its output once, with
    16-bit activations. ``fused=False`` is PyTorch eager as Hugging Face models run:
    RMSNorm upcasts to FP32 (cast, square, mean, scale, cast back, weight: 36 bytes
    per element), GPT-2's ``gelu_new`` is eight element-wise ops (36 bytes per
    element of the MLP width), rotary embeddings are five ops on Q and K (20 bytes).
    ``fused=True`` is Megatron/Transformer Engine style: one read and one write per
    norm, fused bias-GeLU or SwiGLU, fused rotary, fused bias-dropout-add.
    Both: a residual add per part (read 4, write 2 bytes), a transpose of the attention
    output (4), dropout on each part's residual branch when the model has dropout (5).
    """
    sbh, sbq = s * b * m.hidden_size, s * b * m.q_size
    sbf = s * b * active_mlp_width(m)
    sbkv = s * b * m.kv_hidden_size
    rope = m.norm is NormKind.RMSNORM and not m.learned_positions
    if fused:
        norm = 4.0
        rotary = 4.0 * (sbq + sbkv) if rope else 0.0
        activation = 6.0 if m.mlp is MlpKind.SWIGLU else 4.0
    else:
        norm = 36.0 if m.norm is NormKind.RMSNORM else 12.0
        rotary = 20.0 * (sbq + sbkv) if rope else 0.0
        activation = 10.0 if m.mlp is MlpKind.SWIGLU else 36.0
    hidden = (norm + 6.0 + (5.0 if m.dropout else 0.0)) * sbh
    return ElementwiseBytes(attention_hidden=hidden, attention_sharded=4.0 * sbq + rotary,
                            mlp_hidden=hidden, mlp_sharded=activation * sbf)


def block_elementwise_bytes(m: ModelSpec, b: int, s: int, *, fused: bool = False) -> float:
    """Memory traffic of one block's non-matmul forward ops, in bytes
    (:func:`block_elementwise_parts`, both parts together)."""
    return block_elementwise_parts(m, b, s, fused=fused).total()
