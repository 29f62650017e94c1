"""Closed-form costs of the pieces of a training step, each next to its source.

These are the only places where time and memory are computed from physics;
everything else (the cost model, the search, the simulator, the emulator)
composes them. Inputs are device and link figures that calibration may
change; the shape of each formula stays.

Sources (see ``shared/reference/formulas.md`` of the design notes):
- ring all-reduce: ``2(g-1)/g * n/W + 2(g-1)*alpha`` (Patarasuk & Yuan 2009;
  NCCL's bus-bandwidth convention), a reduce-scatter or all-gather half of it: the one
  form (:func:`ring_terms`) the cost model, the simulator, calibration and the profiler use;
- roofline: an op takes ``max(flops / achievable FLOP/s, bytes / memory bandwidth)``
  (Williams et al. 2009); what a GEMM or an attention kernel achieves (tiles and waves, the
  measured GEMM ceiling, FlashAttention) is :mod:`potluck.planner.gemm`'s;
- model states: 16 bytes per parameter for mixed-precision Adam with FP32 master
  weights, ``4 + 12/d`` with the optimizer sharded over ``d`` replicas (ZeRO-1;
  Rajbhandari et al. 2020); 18 for FP32 weights under autocast (``10 + 8/d``) and for
  16-bit weights whose gradients are summed in an FP32 buffer (``6 + 12/d``, Megatron-LM);
- Adam step: memory bound, about 36 bytes of traffic per parameter (read FP32
  master, both moments and the gradient, write them back and the 16-bit copy);
- gradient accumulation: every micro-batch's weight gradients are added into an
  FP32 buffer outside the GEMMs (Megatron-LM's ``param.main_grad.add_(param.grad)``
  hook, megatron/model/distributed.py; PyTorch's AccumulateGrad), a memory-bound
  pass over the stage's parameters;
- ZeRO-2 and ZeRO-3 (Rajbhandari et al., SC'20; FSDP: Zhao et al., VLDB'23): gradients,
  then parameters too, divided over the ``d`` replicas holding them; ZeRO-3 keeps the full
  weights of the block it computes and of one prefetched block (FSDP2's default forward
  prefetch of one unit), ZeRO-2 the full-size gradients of one bucket, here one block;
- optimizer offload (ZeRO-Offload, Ren et al., ATC'21): Adam's moments and an FP32 master
  copy (12 bytes per parameter) in host memory; the step streams the gradients to the
  host over PCIe, runs Adam memory-bound at the host's DRAM bandwidth, and sends the
  updated parameters back;
- overlapped sub-batches (Oases, Li et al. 2023): a chain of segments, each a compute
  followed by a collective whose result the next segment needs, run for ``c`` sub-batches
  side by side on two in-order streams (compute and communication, as CUDA streams
  execute): the exact makespan of that two-machine flow shop (:func:`overlapped_chain_s`);
- all-to-all by pairwise exchange: ``(g-1)*alpha + (g-1)/g * n/W`` for ``n`` bytes per rank
  (Thakur, Rabenseifner & Gropp, IJHPCA 2005, Sec. 4.5), the token exchange of expert
  parallelism (GShard, Lepikhin et al. 2021): two per MoE block in each pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

MEMORY_BANDWIDTH_EFFICIENCY = 0.8  # stas00/ml-engineering: plan on ~80% of advertised rates
ADAM_TRAFFIC_BYTES_PER_PARAM = 36.0
KERNEL_DISPATCH_S = 8e-6  # host-side cost to launch one eager PyTorch op


ALLREDUCE_PASSES = 2.0  # a ring all-reduce: a reduce-scatter, then an all-gather
HALF_RING_PASSES = 1.0  # a reduce-scatter or an all-gather alone


class RingTerms(NamedTuple):
    """The two terms of a ring collective: ``hop_bytes / W + latencies * alpha``."""

    hop_bytes: float  # bytes every hop of the ring carries
    latencies: float  # latencies paid one after the other


def ring_terms(num_bytes: float, ranks: int, passes: float = ALLREDUCE_PASSES) -> RingTerms:
    """A ring collective of ``num_bytes`` over ``ranks`` ranks: ``passes`` times ``ranks - 1``
    steps, each moving ``1/ranks`` of the bytes over every hop and paying one latency
    (Patarasuk & Yuan 2009). ``passes``: 2 for an all-reduce, 1 for a reduce-scatter or an
    all-gather of a ``num_bytes`` result. Nothing to move, or one rank, is no collective
    (no bytes, no latency). ``hop_bytes`` over a measured time is NCCL's bus bandwidth."""
    if ranks <= 1 or num_bytes <= 0:
        return RingTerms(0.0, 0.0)
    steps = ranks - 1
    return RingTerms(passes * steps / ranks * num_bytes, passes * steps)


def ring_collective_time_s(num_bytes: float, ranks: int, bandwidth_bytes_per_s: float,
                           latency_s: float, passes: float = ALLREDUCE_PASSES) -> float:
    """A ring collective (:func:`ring_terms`) on links of the given bandwidth and latency."""
    hop_bytes, latencies = ring_terms(num_bytes, ranks, passes)
    return hop_bytes / bandwidth_bytes_per_s + latencies * latency_s


def ring_allreduce_time_s(num_bytes: float, ranks: int, bandwidth_bytes_per_s: float,
                          latency_s: float) -> float:
    """Ring all-reduce of ``num_bytes`` over ``ranks`` ranks on links of the given bandwidth."""
    return ring_collective_time_s(num_bytes, ranks, bandwidth_bytes_per_s, latency_s,
                                  ALLREDUCE_PASSES)


def ring_allgather_time_s(num_bytes: float, ranks: int, bandwidth_bytes_per_s: float,
                          latency_s: float) -> float:
    """All-gather (or reduce-scatter) of a ``num_bytes`` result: half a ring all-reduce."""
    return ring_collective_time_s(num_bytes, ranks, bandwidth_bytes_per_s, latency_s,
                                  HALF_RING_PASSES)


def pairwise_alltoall_time_s(num_bytes: float, ranks: int, bandwidth_bytes_per_s: float,
                             latency_s: float) -> float:
    """All-to-all of ``num_bytes`` per rank, ``1/ranks`` of it to each rank (itself
    included), over one link per rank of the given bandwidth."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * latency_s + (ranks - 1) / ranks * num_bytes / bandwidth_bytes_per_s


def overlapped_chain_s(compute_s: Sequence[float], comm_s: Sequence[float], chunks: int
                       ) -> float:
    """Makespan of ``chunks`` sub-batches through a chain of segments: segment ``k`` is a
    compute of ``compute_s[k]`` then a collective of ``comm_s[k]`` whose result the
    sub-batch's segment ``k + 1`` needs. One compute stream and one communication stream,
    each running its ops in the order segment by segment, sub-batch by sub-batch (Oases's
    schedule): sub-batch 2 computes while sub-batch 1's collective travels, so each segment
    costs about the slower of the two, plus the first compute and the last collective.
    With one sub-batch it is the plain sum."""
    compute_free = comm_free = 0.0
    ready = [0.0] * chunks  # when each sub-batch's previous collective has ended
    for compute, comm in zip(compute_s, comm_s, strict=True):
        for j in range(chunks):
            compute_free = max(compute_free, ready[j]) + compute
            comm_free = max(comm_free, compute_free) + comm
            ready[j] = comm_free
    return max(compute_free, comm_free)


def roofline_time_s(flops: float, memory_bytes: float, achievable_flops: float,
                    memory_bandwidth_bytes_per_s: float) -> float:
    """An op is bound by whichever of compute and memory traffic takes longer."""
    compute = flops / achievable_flops
    memory = memory_bytes / (memory_bandwidth_bytes_per_s * MEMORY_BANDWIDTH_EFFICIENCY)
    return max(compute, memory)


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter a device keeps; ZeRO-1 shards the optimizer part."""

    weights: float
    grads: float
    optimizer: float
    gathered: float | None = None  # ZeRO-3's all-gathered weights, if not ``weights``

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def gathered_weights(self) -> float:
        """Bytes per parameter of a ZeRO-3 all-gathered (unsharded) weight."""
        return self.weights if self.gathered is None else self.gathered


# 16-bit weights and gradients, FP32 master weights and Adam moments (SC'21; ZeRO):
# gradients summed over micro-batches in the 16-bit .grad (DeepSpeed's fp16 engine).
MIXED_PRECISION_MASTER = StateBytes(2.0, 2.0, 12.0)
# 16-bit weights, their gradients summed over micro-batches in an FP32 buffer held in place
# of the 16-bit .grad, FP32 masters and moments: Megatron-LM's main_grad (--main-grads-dtype
# fp32, the default; megatron/core/distributed/param_and_grad_buffer.py) and potluck's
# runtime (runtime/grads/fp32_accumulation.py): 2 + 4 + 12/d with a distributed optimizer.
MAIN_GRAD_MASTER = StateBytes(2.0, 4.0, 12.0)
# FP32 weights under 16-bit autocast (plus autocast's 16-bit copy of every weight, kept for
# the step), FP32 gradients, Adam moments: what PyTorch AMP and potluck's runtime hold.
FP32_PARAMS_AUTOCAST = StateBytes(6.0, 4.0, 8.0)
FP32 = StateBytes(4.0, 4.0, 8.0)  # plain FP32 training (fp32, tf32 and CPU ranks)
# ZeRO-3 under FSDP2's mixed precision (torchtitan; potluck's runtime): FP32 weight and
# gradient shards, Adam moments, weights all-gathered in 16 bits (MixedPrecisionPolicy
# param_dtype) and no autocast copy kept (its cache is off there).
FSDP_MIXED_PRECISION = StateBytes(4.0, 4.0, 8.0, gathered=2.0)


@dataclass(frozen=True)
class StateSharding:
    """How the model states of the replicas holding the same parameters are split among them,
    and whether the optimizer's share lives in host memory (ZeRO-Offload)."""

    optimizer_shards: int = 1  # ZeRO-1: each replica keeps 1/shards of the optimizer states
    gradient_shards: int = 1  # ZeRO-2
    parameter_shards: int = 1  # ZeRO-3 (FSDP2)
    offload: bool = False  # the optimizer states (and an FP32 master copy) in host memory

    @staticmethod
    def zero1(replicas: int, enabled: bool) -> StateSharding:
        """Optimizer states over ``replicas`` replicas with ZeRO-1, else whole on each."""
        return _sharding(replicas if (enabled and replicas > 1) else 1, 1, False)

    @staticmethod
    def of(replicas: float, zero: int, offload: bool = False) -> StateSharding:
        """The states of ZeRO stage ``zero`` (0-3) over ``replicas`` replicas (a fraction
        where a holder's share is uneven: the divisor of its share)."""
        return _sharding(replicas if replicas > 1 else 1, zero if replicas > 1 else 0, offload)

    @property
    def zero(self) -> int:
        if self.parameter_shards > 1:
            return 3
        if self.gradient_shards > 1:
            return 2
        return 1 if self.optimizer_shards > 1 else 0


NOT_SHARDED = StateSharding()


@cache
def _sharding(shards: int, zero: int, offload: bool) -> StateSharding:
    """One value per setting (the search asks for the same few very often)."""
    if shards <= 1 and not offload:
        return NOT_SHARDED
    return StateSharding(shards if zero >= 1 else 1, shards if zero >= 2 else 1,
                         shards if zero >= 3 else 1, offload)


# ZeRO-Offload (Ren et al., ATC'21): on the host, an FP32 master copy (4 B) and Adam's two
# FP32 moments (8 B) per parameter, whatever the device computes in.
HOST_MASTER_BYTES_PER_PARAM = 4.0
ADAM_MOMENT_BYTES_PER_PARAM = 8.0
HOST_OPTIMIZER_BYTES_PER_PARAM = HOST_MASTER_BYTES_PER_PARAM + ADAM_MOMENT_BYTES_PER_PARAM


def model_state_bytes(params: float, layout: StateBytes = MIXED_PRECISION_MASTER,
                      sharding: StateSharding = NOT_SHARDED) -> float:
    """Weights, gradients and (unless offloaded) Adam states of ``params`` parameters at rest
    on one device, each divided over the replicas sharding it (ZeRO-1/2/3, SC'20). The
    full-size working set of ZeRO-2/3 (one block's gradients or weights) is the caller's
    (:func:`zero_working_bytes`)."""
    optimizer = 0.0 if sharding.offload else layout.optimizer / sharding.optimizer_shards
    return params * (layout.weights / sharding.parameter_shards
                     + layout.grads / sharding.gradient_shards + optimizer)


def host_state_bytes(params: float, sharding: StateSharding = NOT_SHARDED) -> float:
    """Host bytes of an offloaded optimizer over ``params`` parameters: the master copy and
    the moments of the device's share (ZeRO-Offload, ATC'21: 12 bytes per parameter)."""
    if not sharding.offload:
        return 0.0
    return params * HOST_OPTIMIZER_BYTES_PER_PARAM / sharding.optimizer_shards


def zero_working_bytes(block_params: float, layout: StateBytes, sharding: StateSharding,
                       edge_params: float = 0.0) -> float:
    """Full-size states a ZeRO-2/3 device holds on top of its shards: ZeRO-3 (FSDP2) the
    all-gathered weights of the unit it computes and of the one it prefetches (Zhao et al.,
    VLDB'23, forward/backward prefetch of one unit): a block and the larger of a block and
    the stage's ``edge_params`` unit (the embedding, gathered with the first block; the
    final norm and output layer, gathered with the last block); ZeRO-2 the full-size
    gradients of the bucket being reduce-scattered, one block (SC'20, Sec. 5.2:
    bucketized reduce-scatter)."""
    working = 0.0
    if sharding.parameter_shards > 1:
        working += (block_params + max(block_params, edge_params)) * layout.gathered_weights
    if sharding.gradient_shards > 1:
        working += block_params * layout.grads
    return working


def root_unit_bytes(root_params: float, layout: StateBytes) -> float:
    """ZeRO-3's root unit (the embedding, final norm and output layer as one unit: FSDP1's
    root FlatParameter, torchtitan's ``fully_shard(model)``): its weights gathered from the
    first forward op to the last backward op, and its full-size gradient in the same 16-bit
    dtype from the head's backward (the first) to the embedding's (the last), when the unit
    is reduce-scattered (torch/distributed/fsdp: FSDP1 does not reshard the root after
    forward; FSDP2's root reshards after forward and gathers again for the backward)."""
    return 2.0 * root_params * layout.gathered_weights


def zero3_grad_accumulation_bytes(element_bytes: float, reduce_bytes: float,
                                  shards: float) -> float:
    """Memory traffic per parameter and micro-batch of ZeRO-3's gradient accumulation: the
    full-size 16-bit gradient cast to the reduce dtype where that is wider (FSDP1's
    post-backward ``flat_param.grad.to(reduce_dtype)``, FSDP2's copy into its reduce-scatter
    input: read ``element_bytes``, write ``reduce_bytes``), then the reduce-scattered shard
    added into the FP32 sharded gradient (read 4 and the shard, write 4), 1/``shards`` of
    the parameters."""
    cast = element_bytes + reduce_bytes if reduce_bytes > element_bytes else 0.0
    return cast + (8.0 + reduce_bytes) / shards


def offloaded_step_time_s(params: float, grad_bytes: float, weight_bytes: float,
                          host_bandwidth_bytes_per_s: float, adam_params_on_host: float,
                          host_memory_bandwidth_bytes_per_s: float) -> float:
    """ZeRO-Offload's step of a device's ``params`` (ATC'21, Sec. 4): its gradients to the host
    (``grad_bytes`` each over its PCIe link), Adam on the host, memory-bound at the host's DRAM
    bandwidth over the ``adam_params_on_host`` parameters every rank of the machine steps at
    once (:data:`ADAM_TRAFFIC_BYTES_PER_PARAM` each), and the updated parameters back
    (``weight_bytes`` each)."""
    transfers = params * (grad_bytes + weight_bytes) / host_bandwidth_bytes_per_s
    adam = adam_params_on_host * ADAM_TRAFFIC_BYTES_PER_PARAM / (
        host_memory_bandwidth_bytes_per_s * MEMORY_BANDWIDTH_EFFICIENCY)
    return transfers + adam


def grad_accumulation_time_s(params: float, bytes_per_param: float,
                             memory_bandwidth_bytes_per_s: float) -> float:
    """One micro-batch's weight gradients added into the accumulation buffer: a memory-bound
    pass of ``bytes_per_param`` bytes over each of ``params`` parameters (e.g. 10 for
    Megatron-LM's hook: read the 16-bit gradient, read and write the FP32 ``main_grad``)."""
    return params * bytes_per_param / (memory_bandwidth_bytes_per_s * MEMORY_BANDWIDTH_EFFICIENCY)


def adam_step_time_s(params: float, memory_bandwidth_bytes_per_s: float) -> float:
    return params * ADAM_TRAFFIC_BYTES_PER_PARAM / (
        memory_bandwidth_bytes_per_s * MEMORY_BANDWIDTH_EFFICIENCY
    )
