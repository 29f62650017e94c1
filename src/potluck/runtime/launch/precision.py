"""The torch settings that make a rank compute in its dtype: autocast and TF32 matmuls.

The planner decides which dtype each device computes in
(:func:`potluck.planner.gemm.effective_dtype`: bf16 falls back to fp16 without
bf16 support, tf32 to fp32 without TF32 tensor cores, CPU ranks train in fp32);
this module is the one place that says what torch does for each:

========  ================  ==============================================
dtype     autocast          FP32 matmuls and cuDNN convolutions
========  ================  ==============================================
bf16      bfloat16          full FP32 (TF32 off)
fp16      float16           full FP32 (TF32 off)
tf32      none              TF32 tensor cores (10-bit mantissa inputs)
fp32      none              full FP32 (TF32 off)
========  ================  ==============================================

Weights, gradients and optimizer states stay FP32 in every case (autocast casts
inside the forward). The TF32 switches are ``torch.backends.cuda.matmul.allow_tf32``
and ``torch.backends.cudnn.allow_tf32`` (PyTorch, "TensorFloat-32 (TF32) on Ampere
(and later) devices", https://pytorch.org/docs/stable/notes/cuda.html); they are
process-wide, so :func:`apply_precision` sets both explicitly, whatever the
defaults of the torch version.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from potluck.plans import DType


@dataclass(frozen=True)
class TorchPrecision:
    """How torch computes for one dtype."""

    autocast: torch.dtype | None  # None: no autocast, FP32 tensors throughout
    tf32: bool  # FP32 matmuls and convolutions on TF32 tensor cores


_PRECISIONS = {
    DType.BF16: TorchPrecision(torch.bfloat16, tf32=False),
    DType.FP16: TorchPrecision(torch.float16, tf32=False),
    DType.TF32: TorchPrecision(None, tf32=True),
    DType.FP32: TorchPrecision(None, tf32=False),
}


def torch_precision(dtype: DType) -> TorchPrecision:
    """The torch settings of ``dtype`` (the dtype the rank computes in, not the one asked)."""
    return _PRECISIONS[dtype]


def apply_precision(precision: TorchPrecision) -> None:
    """Switch TF32 matmuls and convolutions on or off for this process."""
    torch.backends.cuda.matmul.allow_tf32 = precision.tf32
    torch.backends.cudnn.allow_tf32 = precision.tf32
