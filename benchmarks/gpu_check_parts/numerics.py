"""(g) swap against no swap, (h) optimizer offload against plain AdamW, on one GPU.

(g) One forward and backward of a bf16 plan whose stage swaps its saved activations to
host memory, and of the same plan without swapping: every gradient must equal the
unswapped one (a swapped tensor comes back with the values it left with, so up to the
kernels' own run-to-run noise: ``GRAD_TOLERANCE``, relative, per parameter), and the bytes
the memory ledger saw stashed in host memory must be within ``STASH_TOLERANCE`` of the
plan's predicted swapped-out activation bytes (``DeviceMemory.swapped_out_bytes``): a
swap that also moves autocast's 16-bit weight copies stashes far more.

(h) Three steps of a plan whose optimizer is offloaded to host memory, in bf16 and in
fp16, against the same plan with the plain (device) AdamW: every loss within
``LOSS_TOLERANCE``, every parameter within ``PARAM_TOLERANCE`` (relative, per parameter:
the device copy is the 16-bit rounding of the FP32 master), and every floating parameter
held on the device in the 16-bit dtype (ZeRO-Offload's layout,
:mod:`potluck.runtime.grads.offload`).

The ranks' work (:func:`one_step_grads`, :func:`three_steps`) runs in spawned processes;
the comparisons are pure functions of what they return.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from gpu_check_parts.common import Outcome, one_gpu_cluster, run_on_gpus, small_llama

GRAD_TOLERANCE = 1e-2  # bf16: a gradient's rounding after other kernels' summation orders
STASH_TOLERANCE = 0.25
LOSS_TOLERANCE = 2e-2  # as tests/runtime/test_gpu.py allows a 16-bit run
PARAM_TOLERANCE = 1e-2  # bf16 rounding of the master is 2^-9 relative
OFFLOAD_STEPS = 3
LR = 1e-3
RUN_TIMEOUT_S = 60.0
HALF = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}


@dataclass(frozen=True)
class Shape:
    """What (g) and (h) train: the model and the batch."""

    model: object
    global_batch: int = 4
    seq_len: int = 256


def check_shape() -> Shape:
    return Shape(small_llama())


def tiny_shape() -> Shape:
    """The sanitizer's (i): every kernel launch is checked in Python, so a tiny model."""
    return Shape(replace(small_llama(), name="llama-64x2", hidden_size=64, ffn_hidden_size=172,
                         num_heads=4, num_kv_heads=2, num_layers=2), 2, 32)


def one_gpu_plan(device: str, shape: Shape, dtype: str, *, swap: str = "none",
                 offload: str = "none"):
    """``shape`` on one GPU, one micro-batch per step, with the given swap and offload."""
    from potluck import api

    return api.plan(one_gpu_cluster(device), shape.model, global_batch=shape.global_batch,
                    seq_len=shape.seq_len, dtype=dtype, tp=1, pp=1, dp=1,
                    micro_batch_size=shape.global_batch, recompute="none", swap=swap,
                    offload=offload).best


# ---- in the rank ----------------------------------------------------------------------------


def one_step_grads(plan, seed: int = 0) -> dict:
    """This rank's gradients (FP32 copies on the host, by name) after one forward and
    backward of step 0's rows, the loss, and the host bytes the ledger saw at its peak."""
    from potluck.runtime.launch.session import start
    from potluck.runtime.loop.batches import RandomTokens
    from potluck.runtime.models.build import build_model
    from potluck.runtime.parallel_model import parallelize

    session = start(plan, timeout_s=RUN_TIMEOUT_S)
    try:
        with session.guard():
            model = parallelize(build_model(plan.model), session, seed=seed)
            shape = plan.training
            rows = RandomTokens(plan.model.vocab_size, shape.seq_len, shape.global_batch,
                                seed).replica_rows(0, *session.layout.batch_rows)
            model.ledger.start_step()
            output = model.forward_backward(rows)
            grads = {name: p.grad.detach().float().cpu() for name, p in model.named_parameters()
                     if p.grad is not None}
            return {"loss": float(output.loss), "grads": grads,
                    "stash_bytes": float(model.ledger.peak().host_bytes)}
    finally:
        session.close()


def three_steps(plan, steps: int = OFFLOAD_STEPS, seed: int = 0) -> dict:
    """Losses of ``steps`` training steps, then every parameter's device dtype and value."""
    from potluck.runtime.launch.session import start
    from potluck.runtime.loop.batches import RandomTokens
    from potluck.runtime.loop.trainer import Trainer
    from potluck.runtime.models.build import build_model
    from potluck.runtime.parallel_model import parallelize

    session = start(plan, timeout_s=RUN_TIMEOUT_S)
    try:
        with session.guard():
            model = parallelize(build_model(plan.model), session, seed=seed)
            trainer = Trainer(model, lr=LR)
            shape = plan.training
            data = RandomTokens(plan.model.vocab_size, shape.seq_len, shape.global_batch, seed)
            losses = [trainer.step(data.replica_rows(k, *session.layout.batch_rows)).loss
                      for k in range(steps)]
            model.flush()
            params = dict(model.named_parameters())
            return {"losses": losses,
                    "dtypes": {n: str(p.dtype) for n, p in params.items() if p.is_floating_point()},
                    "params": {n: p.detach().float().cpu() for n, p in params.items()}}
    finally:
        session.close()


# ---- the comparisons ------------------------------------------------------------------------


def relative_difference(a, b) -> float:
    """``|a - b| / |b|`` (L2 norms; 0 for two zero tensors)."""
    scale = float(b.float().norm())
    difference = float((a.float() - b.float()).norm())
    return difference / scale if scale > 0 else (0.0 if difference == 0 else math.inf)


def grads_match(reference: Mapping, swapped: Mapping,
                tolerance: float = GRAD_TOLERANCE) -> tuple[bool, str]:
    """Every gradient of ``swapped`` within ``tolerance`` of ``reference``'s, none missing."""
    if set(reference) != set(swapped):
        return False, f"different gradients: {sorted(set(reference) ^ set(swapped))[:3]}"
    differences = {n: relative_difference(swapped[n], reference[n]) for n in reference}
    worst = max(differences, key=differences.get)
    equal = sum(1 for n in reference if bool((swapped[n] == reference[n]).all()))
    return differences[worst] <= tolerance, (
        f"{equal} of {len(reference)} gradients bitwise equal, largest relative difference "
        f"{differences[worst]:.1e} ({worst}; at most {tolerance:g})")


def stash_matches(stashed_bytes: float, predicted_bytes: float,
                  tolerance: float = STASH_TOLERANCE) -> tuple[bool, str]:
    """The ledger's stash within ``tolerance`` (relative) of the predicted activation bytes."""
    shown = f"stashed {stashed_bytes / 1e6:.1f} MB, predicted {predicted_bytes / 1e6:.1f} MB"
    if predicted_bytes <= 0:
        return False, f"{shown}: the plan predicts no swapped activations"
    error = stashed_bytes / predicted_bytes - 1
    return abs(error) <= tolerance, f"{shown} ({error:+.0%}, at most +-{tolerance:.0%})"


def offload_matches(plain: Mapping, offloaded: Mapping, dtype: str) -> tuple[bool, str]:
    """(h)'s verdict: losses, parameters and the offloaded run's 16-bit device dtypes."""
    problems = []
    losses, reference = offloaded["losses"], plain["losses"]
    worst_loss = max((abs(a - b) for a, b in zip(losses, reference, strict=True)),
                     default=math.inf) if len(losses) == len(reference) else math.inf
    if not all(math.isfinite(x) for x in losses) or worst_loss > LOSS_TOLERANCE:
        problems.append(f"losses {losses} against {reference}")
    wide = sorted(n for n, d in offloaded["dtypes"].items() if d != HALF[dtype])
    if wide:
        problems.append(f"{len(wide)} device parameters not {HALF[dtype]} ({wide[0]}: "
                        f"{offloaded['dtypes'][wide[0]]})")
    worst_param = max((relative_difference(offloaded["params"][n], p)
                       for n, p in plain["params"].items()), default=math.inf)
    if worst_param > PARAM_TOLERANCE:
        problems.append(f"a parameter differs by {worst_param:.1e} (at most {PARAM_TOLERANCE:g})")
    if problems:
        return False, "; ".join(problems)
    return True, (f"{OFFLOAD_STEPS} steps: losses within {worst_loss:.1e}, parameters within "
                  f"{worst_param:.1e}, device parameters {HALF[dtype]}")


# ---- the parts ----------------------------------------------------------------------------


def check_swap(device: str, shape: Shape, timeout_s: float) -> Outcome:
    """(g): swap to host in bf16 against no swap."""
    from potluck.planner.evaluate import predict

    swapped_plan = one_gpu_plan(device, shape, "bf16", swap="host")
    plain = _rank(one_gpu_plan(device, shape, "bf16"), one_step_grads, timeout_s / 2)
    swapped = _rank(swapped_plan, one_step_grads, timeout_s / 2)
    grads_ok, grads = grads_match(plain["grads"], swapped["grads"])
    predicted = sum(m.swapped_out_bytes for m in predict(swapped_plan).memory)
    stash_ok, stash = stash_matches(swapped["stash_bytes"], predicted)
    return Outcome(f"swap bf16 ({shape.model.name})", grads_ok and stash_ok, f"{grads}; {stash}")


def check_offload(device: str, shape: Shape, dtype: str, timeout_s: float) -> Outcome:
    """(h): optimizer offload in ``dtype`` against plain AdamW after three steps."""
    plain = _rank(one_gpu_plan(device, shape, dtype), three_steps, timeout_s / 2)
    offloaded = _rank(one_gpu_plan(device, shape, dtype, offload="optimizer"), three_steps,
                      timeout_s / 2)
    return Outcome(f"offload {dtype} ({shape.model.name})",
                   *offload_matches(plain, offloaded, dtype))


def _rank(plan, fn, timeout_s: float):
    return run_on_gpus(plan, None, timeout_s, fn, (plan,))


def parts(shape: Shape) -> list[tuple[str, float, object]]:
    """(g) and (h) as ``(label, timeout_s, body(device, timeout_s))``."""
    return [("g: swap", 2 * RUN_TIMEOUT_S, lambda d, t: check_swap(d, shape, t)),
            *[(f"h: offload {dtype}", 2 * RUN_TIMEOUT_S,
               lambda d, t, dtype=dtype: check_offload(d, shape, dtype, t))
              for dtype in ("bf16", "fp16")]]
