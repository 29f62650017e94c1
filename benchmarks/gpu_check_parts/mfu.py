"""(j) One step of four Llama-7B-wide blocks at sequence 4096, as MFU.

The model is LLaMA-2 7B cut to four blocks (hidden 4096, 32 heads, MLP 11008, its
32000-token vocabulary), planned on this one GPU in bf16 at micro-batch 1 (the planner
picks the recomputation that fits) and trained ``MFU_STEPS`` steps through potluck's
runtime; the median step after ``MFU_WARMUP`` warm-up steps is reported as model FLOPs
utilisation (PaLM's MFU, Chowdhery et al. 2022, appendix B): the model's training FLOPs
(:func:`potluck.model.counts.model_flops_per_token`, no recomputation counted) per second
over the catalog's bf16 dense peak of this GPU (:func:`potluck.planner.gemm.peak_flops`),
beside the plan's predicted MFU.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from gpu_check_parts.common import Outcome, one_gpu_cluster, run_on_gpus

MFU_SEQ_LEN = 4096
MFU_GLOBAL_BATCH = 1
MFU_STEPS = 4
MFU_WARMUP = 2
MFU_TIMEOUT_S = 90.0


def mfu_model():
    from potluck.model.spec import PRESETS

    return replace(PRESETS["llama2-7b"], name="llama-7b-wide-x4", num_layers=4,
                   max_seq_len=MFU_SEQ_LEN)


@dataclass(frozen=True)
class Mfu:
    tokens: int
    step_time_s: float
    model_flops: float  # one step's
    peak_flops: float  # the GPU's catalog bf16 peak, per second

    @property
    def achieved_flops(self) -> float:
        return self.model_flops / self.step_time_s

    @property
    def mfu(self) -> float:
        return self.achieved_flops / self.peak_flops


def step_mfu(model, seq_len: int, tokens: int, step_time_s: float, peak_flops: float) -> Mfu:
    """One step's MFU: ``tokens`` tokens of sequences of ``seq_len`` in ``step_time_s``."""
    from potluck.model.counts import model_flops_per_token

    return Mfu(tokens, step_time_s, model_flops_per_token(model, seq_len) * tokens, peak_flops)


def bf16_peak_flops(device: str) -> float:
    from potluck.cluster.catalog import lookup
    from potluck.planner.gemm import peak_flops
    from potluck.plans import DType

    return peak_flops(lookup(device), DType.BF16)


def mfu_plan(device: str):
    from potluck import api

    return api.plan(one_gpu_cluster(device), mfu_model(), global_batch=MFU_GLOBAL_BATCH,
                    seq_len=MFU_SEQ_LEN, dtype="bf16", tp=1, pp=1, dp=1,
                    micro_batch_size=1).best


def measured_step_s(step_times_s: list[float]) -> float:
    """The median step after warm-up (the last step if there were no more)."""
    timed = step_times_s[MFU_WARMUP:] or step_times_s[-1:]
    return statistics.median(timed)


def mfu_line(result: Mfu, predicted_mfu: float | None, recompute: str) -> str:
    predicted = f", predicted {predicted_mfu:.1%}" if predicted_mfu is not None else ""
    return (f"MFU {result.mfu:.1%}{predicted}: {result.tokens} tokens in "
            f"{result.step_time_s * 1e3:.0f} ms, {result.achieved_flops / 1e12:.0f} of "
            f"{result.peak_flops / 1e12:.0f} TFLOP/s (recompute {recompute})")


def run_mfu(device: str, timeout_s: float) -> Outcome:
    from potluck.runtime.options import TrainOptions

    plan = mfu_plan(device)
    options = TrainOptions(steps=MFU_STEPS, progress=False, timeout_s=timeout_s)
    history = run_on_gpus(plan, options, timeout_s)
    tokens = plan.training.global_batch * plan.training.seq_len
    result = step_mfu(plan.model, plan.training.seq_len, tokens,
                      measured_step_s([m.step_time_s for m in history]), bf16_peak_flops(device))
    finite = all(math.isfinite(m.loss) for m in history)
    predicted = plan.prediction.mfu if plan.prediction is not None else None
    recompute = plan.stage_memory(0, 0).recompute.value
    return Outcome("mfu 4 x llama-7b blocks, seq 4096", finite,
                   mfu_line(result, predicted, recompute))
