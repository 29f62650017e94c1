"""Dynamic loss scaling for fp16 training (Micikevicius et al., "Mixed Precision
Training", ICLR 2018; the policy of ``torch.amp.GradScaler``).

fp16 has 5 exponent bits: gradients below about 6e-8 flush to zero. The loss is
multiplied by ``scale`` before the backward pass, so every gradient is
``scale`` times larger and stays representable; the trainer divides it out
before clipping and the optimizer step. When any gradient of any rank is inf
or NaN the step is skipped on every rank alike (the check reads the global
gradient norm, which every rank already all-reduces) and the scale is
halved; after ``growth_interval`` finite steps in a row it doubles.

potluck turns it on where training runs in fp16 autocast (GPUs without bf16:
V100, T4, ...); bf16 and fp32 runs need none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class DynamicLossScale:
    """The current scale and the policy that moves it; JSON-safe state for checkpoints."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000  # finite steps in a row before the scale grows
    min_scale: float = 1.0
    finite_steps: int = 0  # finite steps since the last change

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"loss scale must be a positive finite number, got {self.scale}")
        if self.growth_factor <= 1.0 or not 0.0 < self.backoff_factor < 1.0:
            raise ValueError("loss scale needs growth_factor > 1 and 0 < backoff_factor < 1")
        if self.growth_interval < 1:
            raise ValueError("loss scale growth_interval must be at least 1")

    def update(self, grads_finite: bool) -> None:
        """After a step: back off on an overflow, grow after a run of finite steps."""
        if not grads_finite:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.finite_steps = 0
            return
        self.finite_steps += 1
        if self.finite_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.finite_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "finite_steps": self.finite_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.finite_steps = int(state["finite_steps"])
