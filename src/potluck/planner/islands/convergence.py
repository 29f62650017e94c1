"""How many more tokens rare synchronization needs to reach the loss of synchronous training.

Two steps, each with its source:

1. **Loss gap at equal tokens**: ``loss(islands) / loss(synchronous data parallelism) - 1`` as
   a function of the number of islands M, the inner steps H, the compression and, for
   ``bounded``, the staleness (:func:`loss_gap`).
2. **Loss gap to extra tokens**: with Chinchilla's fit of the loss of a model of N parameters
   trained on D tokens, ``L(N, D) = E + A / N^alpha + B / D^beta`` (Hoffmann et al. 2022,
   arXiv:2203.15556, section 3.3, approach 3: E 1.69, A 406.4, B 410.7, alpha 0.34, beta
   0.28), the islands reach synchronous training's loss at D tokens after ``D * factor``
   tokens, where ``(1 + gap) * L(N, D * factor) = L(N, D)`` (:func:`token_factor`); a gap
   the data term cannot absorb is never reached (``inf``).

What the sources say, and what is assumed where they give no number we could retrieve:

- DiLoCo (Douillard et al. 2023, arXiv:2311.08105, abstract): on C4, 8 workers with H = 500
  perform as well as fully synchronous optimization while communicating 500 times less.
- Scaling Laws for DiLoCo (Charles et al. 2025, arXiv:2503.09799, abstract and section 4):
  M = 1 can outperform data parallelism; the loss gap of more replicas grows with M and
  shrinks as models grow; larger H costs a little loss. Its per-size table of loss against
  data parallelism could not be retrieved here, so the magnitudes in
  :data:`ASSUMED_GAP_BY_ISLANDS` and :data:`ASSUMED_H_SCALE` are **assumptions**, chosen to
  be conservative: they charge M = 8, H = 500 a 2 % loss gap where DiLoCo 2023 reports none.
- OpenDiLoCo (Jaghouar et al. 2024, arXiv:2407.07852, abstract): the pseudo-gradients can
  be all-reduced in FP16 without any performance degradation. BF16 (same width, fewer
  mantissa bits) is assumed the same.
- INTELLECT-1 (Jaghouar et al. 2024, arXiv:2412.01152) all-reduced int8 pseudo-gradients;
  no loss figure against FP32 was retrieved: :data:`ASSUMED_INT8_GAP`.
- Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512, abstract): fragments and
  low-precision exchanges reach similar quality to DiLoCo; no per-F figure was retrieved:
  :data:`ASSUMED_FRAGMENT_GAP`.
- ``bounded``: stale synchronous parallelism converges with a bound that grows with the
  staleness (SSP, Ho et al. NeurIPS'13, theorem 1); HetPipe (Park et al. ATC'20) trains with
  a bounded staleness of wave-synchronous updates. No loss-per-staleness figure exists for
  LLMs: assumed conservatively that an update applied ``s`` pushes late costs what DiLoCo
  costs with ``H * (s + 1)`` inner steps (its replicas drift that many steps apart).

Outside the tabulated range (M above 8, H outside 10-500) the nearest point is used and the
penalty's ``notes`` say so, rather than extrapolating silently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from potluck.plans.islands import Compression, Islands, SyncMethod

CHINCHILLA_E = 1.69  # Hoffmann et al. 2022, arXiv:2203.15556, section 3.3 (approach 3)
CHINCHILLA_A = 406.4  # ibid.
CHINCHILLA_B = 410.7  # ibid.
CHINCHILLA_ALPHA = 0.34  # ibid.
CHINCHILLA_BETA = 0.28  # ibid.
CHINCHILLA_TOKENS_PER_PARAM = 20.0  # compute-optimal tokens per parameter (ibid., table 3)

ASSUMED_GAP_BY_ISLANDS = ((1, 0.0), (2, 0.005), (4, 0.01), (8, 0.02))
"""Assumed relative loss gap at H = 500 against synchronous training, per number of islands
(see the module docstring: conservative against DiLoCo 2023's no gap at M = 8, H = 500;
M = 1 charged nothing although Charles et al. 2025 find it can do better)."""
ASSUMED_H_SCALE = ((10, 0.4), (50, 0.6), (100, 0.7), (250, 0.85), (500, 1.0))
"""Assumed share of the H = 500 gap at smaller H (more frequent outer steps drift less;
Charles et al. 2025 find loss grows slowly with H). Interpolated in log H."""
ASSUMED_INT8_GAP = 0.001
"""Assumed extra relative loss of an int8 exchange (INTELLECT-1 used it; no figure found)."""
ASSUMED_FRAGMENT_GAP = 0.0
"""Assumed extra relative loss of streaming fragments (Streaming DiLoCo: similar quality)."""


@dataclass(frozen=True)
class Penalty:
    """What rare synchronization costs in convergence."""

    loss_gap: float  # relative loss above synchronous training at equal tokens
    token_factor: float  # tokens times this reach synchronous training's loss (inf: never)
    notes: tuple[str, ...] = ()  # where the model is used outside its sources' range


NO_PENALTY = Penalty(0.0, 1.0)


def chinchilla_loss(params: float, tokens: float) -> float:
    """Chinchilla's fitted loss of ``params`` parameters trained on ``tokens`` tokens."""
    return (CHINCHILLA_E + CHINCHILLA_A / params ** CHINCHILLA_ALPHA
            + CHINCHILLA_B / tokens ** CHINCHILLA_BETA)


def token_factor(loss_gap: float, params: float, tokens: float) -> float:
    """How many times ``tokens`` a run whose loss is ``1 + loss_gap`` times synchronous
    training's needs to reach synchronous training's loss at ``tokens`` (inf: never)."""
    if loss_gap <= 0.0:
        return 1.0
    target = chinchilla_loss(params, tokens) / (1.0 + loss_gap)
    data_term = target - CHINCHILLA_E - CHINCHILLA_A / params ** CHINCHILLA_ALPHA
    if data_term <= 0.0:
        return math.inf
    needed = (CHINCHILLA_B / data_term) ** (1.0 / CHINCHILLA_BETA)
    return needed / tokens


def _interpolate_log(points: tuple[tuple[int, float], ...], x: float) -> tuple[float, bool]:
    """``points`` interpolated linearly in log x, and whether x lies outside them (then the
    nearest end's value)."""
    xs = [p[0] for p in points]
    if x <= xs[0] or x >= xs[-1]:
        value = points[0][1] if x <= xs[0] else points[-1][1]
        return value, not xs[0] <= x <= xs[-1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + t * (y1 - y0), False
    raise AssertionError("unreachable: x lies between the points")


def loss_gap(islands: Islands) -> tuple[float, tuple[str, ...]]:
    """The relative loss gap of ``islands`` against synchronous training at equal tokens,
    and notes where the model leaves its sources' range."""
    if not islands.split:
        return 0.0, ()
    h = islands.inner_steps
    if islands.sync is SyncMethod.BOUNDED:
        h *= islands.staleness + 1
    by_islands, outside_m = _interpolate_log(ASSUMED_GAP_BY_ISLANDS, islands.count)
    h_scale, outside_h = _interpolate_log(ASSUMED_H_SCALE, h)
    gap = by_islands * h_scale
    if islands.compression is Compression.INT8:
        gap += ASSUMED_INT8_GAP
    if islands.fragments > 1:
        gap += ASSUMED_FRAGMENT_GAP
    notes = tuple(note for outside, note in (
        (outside_m, f"{islands.count} islands: the convergence model's sources go up to 8; "
                    "charged as 8"),
        (outside_h, f"{h} inner steps between exchanges (H times staleness + 1 for bounded): "
                    "the convergence model's sources cover 10-500; charged as the nearest"),
    ) if outside)
    return gap, notes


def penalty(islands: Islands, params: float, tokens: float) -> Penalty:
    """The convergence penalty of ``islands`` for a model of ``params`` parameters trained
    to synchronous training's loss at ``tokens`` tokens."""
    gap, notes = loss_gap(islands)
    return Penalty(gap, token_factor(gap, params, tokens), notes)


def default_tokens(params: float) -> float:
    """Chinchilla's compute-optimal token count for ``params`` parameters."""
    return CHINCHILLA_TOKENS_PER_PARAM * params
