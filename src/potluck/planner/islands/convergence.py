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

What the sources say, and what is assumed where they give no number:

- Scaling Laws for DiLoCo (Charles et al. 2025, arXiv:2503.09799): evaluation loss of DiLoCo
  with M = 2, 4, 8 replicas against data parallelism, at H = 30, by model size: table 4
  (35M to 2.4B, M up to 8) and table 5 (4B and 10B, M up to 4), kept as
  :data:`DILOCO_LOSS_GAP` and interpolated in log N and log M. The gap shrinks as models grow
  and goes below zero for M = 2 from 2.4B on; a negative gap is charged as none (a
  conservative choice). Models outside 35M-10B take the nearest size's gap; M = 8 beyond
  2.4B (not measured there) takes its 2.4B gap; more than 8 islands take M = 8's: each is
  said in the penalty's ``notes``.
- H: Charles et al. 2025 (section 5.1, figure 9): beyond H = 1 the loss grows with H, less
  for larger models (a figure, no table). DiLoCo (Douillard et al. 2023, arXiv:2311.08105,
  section 3.1) gives one number: for a 150M model on 8 non-i.i.d. workers, perplexity at
  H = 1000 is 2.9 % above H = 50 (table 3: perplexity about 15). :func:`h_scale` turns it
  into the gap's growth per doubling of H, relative to the gap at H = 30 of that size and M
  (:data:`DILOCO_LOSS_GAP`), and **assumes** the same relative growth at every size and M
  (conservative for larger models, which figure 9 shows grow less; non-i.i.d. data, as
  DiLoCo's, is also the harder case). DiLoCo's abstract reports 8 workers with H = 500
  performing as well as fully synchronous optimization.
- OpenDiLoCo (Jaghouar et al. 2024, arXiv:2407.07852, abstract): the pseudo-gradients can
  be all-reduced in FP16 without any performance degradation. BF16 (same width, fewer
  mantissa bits) is assumed the same.
- INTELLECT-1 (Jaghouar et al. 2024, arXiv:2412.01152) all-reduced int8 pseudo-gradients;
  no loss figure against FP32 was found: :data:`ASSUMED_INT8_GAP`.
- Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512, abstract): fragments and
  low-precision exchanges reach similar quality to DiLoCo; no per-F figure was found:
  :data:`ASSUMED_FRAGMENT_GAP`.
- ``bounded``: stale synchronous parallelism converges with a bound that grows with the
  staleness (SSP, Ho et al. NeurIPS'13, theorem 1); HetPipe (Park et al. ATC'20) trains with
  a bounded staleness of wave-synchronous updates. No loss-per-staleness figure exists for
  LLMs: assumed conservatively that an update applied ``s`` pushes late costs what DiLoCo
  costs with ``H * (s + 1)`` inner steps (its replicas drift that many steps apart).
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

DILOCO_LOSS_GAP: dict[int, tuple[tuple[float, float], ...]] = {
    # M: (model parameters, relative loss against data parallelism at H = 30), Charles et al.
    # 2025, arXiv:2503.09799, table 4 (35M-2.4B) and table 5 (4B, 10B)
    2: ((35e6, 0.007), (90e6, 0.005), (180e6, 0.003), (335e6, 0.001), (550e6, 0.002),
        (1.3e9, 0.002), (2.4e9, -0.001), (4e9, -0.0018), (10e9, -0.0019)),
    4: ((35e6, 0.020), (90e6, 0.015), (180e6, 0.011), (335e6, 0.009), (550e6, 0.007),
        (1.3e9, 0.005), (2.4e9, 0.003), (4e9, 0.0018), (10e9, 0.0029)),
    8: ((35e6, 0.039), (90e6, 0.031), (180e6, 0.023), (335e6, 0.020), (550e6, 0.017),
        (1.3e9, 0.013), (2.4e9, 0.011)),
}
TABLE_H = 30  # the H of DILOCO_LOSS_GAP (Charles et al. 2025, section 3)
H_ABLATION_PPL_INCREASE = 0.029  # DiLoCo 2023, section 3.1: perplexity at H=1000 over H=50
H_ABLATION_RANGE = (50, 1000)  # ibid.: the two H compared
H_ABLATION_PPL = 15.0  # ibid., table 3: 8 non-i.i.d. replicas of the 150M model, 15.02
H_ABLATION_PARAMS = 150e6  # ibid.: the 150M model
H_ABLATION_REPLICAS = 8  # ibid.
H_RANGE = (10, 1000)  # H the model is used for without a note (the sources: 1-300, 50-2000)
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


def _interpolate_log(points: tuple[tuple[float, float], ...], x: float) -> tuple[float, bool]:
    """``points`` interpolated linearly in log x, and whether x lies outside them (then the
    nearest end's value)."""
    if x < points[0][0] or x > points[-1][0]:
        return (points[0][1] if x < points[0][0] else points[-1][1]), True
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) if x1 > x0 else 0.0
            return y0 + t * (y1 - y0), False
    return points[0][1], False  # one point


def published_gap(islands: int, params: float) -> tuple[float, tuple[str, ...]]:
    """DiLoCo's relative loss gap at H = 30 for ``islands`` replicas of a ``params`` model
    (:data:`DILOCO_LOSS_GAP`, interpolated in log M between the measured M around it), and
    notes where it leaves the table."""
    if islands <= 1:
        return 0.0, ()
    notes = [f"{islands} islands: the convergence model's sources go up to 8; charged as 8"
             ] if islands > 8 else []
    m = min(islands, 8)
    ms = sorted(DILOCO_LOSS_GAP)
    around = sorted({max(x for x in ms if x <= m), min(x for x in ms if x >= m)})
    by_m = []
    for replicas in around:
        gap, outside = _interpolate_log(DILOCO_LOSS_GAP[replicas], params)
        if outside:
            notes.append(f"{params / 1e9:.3g}B parameters with {replicas} replicas is outside "
                         "the convergence model's table; the nearest size's gap charged")
        by_m.append((float(replicas), gap))
    return _interpolate_log(tuple(by_m), m)[0], tuple(notes)


def h_scale(h: float) -> float:
    """The loss gap at ``h`` inner steps relative to the gap at :data:`TABLE_H` (see the
    module docstring): ``1 + k * log2(h / 30)``, ``k`` from DiLoCo's H ablation (its
    perplexity increase as a relative loss increase, over the gap of that model at H = 30 and
    the doublings between the two H compared); never below 0."""
    loss = math.log(H_ABLATION_PPL)
    relative_increase = math.log1p(H_ABLATION_PPL_INCREASE) / loss
    low, high = H_ABLATION_RANGE
    gap_at_table_h = published_gap(H_ABLATION_REPLICAS, H_ABLATION_PARAMS)[0]
    per_doubling = relative_increase / (gap_at_table_h * math.log2(high / low))
    return max(0.0, 1.0 + per_doubling * math.log2(h / TABLE_H))


def loss_gap(islands: Islands, params: float) -> tuple[float, tuple[str, ...]]:
    """The relative loss gap of ``islands`` against synchronous training at equal tokens for
    a model of ``params`` parameters (never below 0), and notes where the model leaves its
    sources' range."""
    if not islands.split:
        return 0.0, ()
    h = islands.inner_steps
    if islands.sync is SyncMethod.BOUNDED:
        h *= islands.staleness + 1
    at_table_h, notes = published_gap(islands.count, params)
    gap = max(0.0, at_table_h) * h_scale(h)
    if islands.compression is Compression.INT8:
        gap += ASSUMED_INT8_GAP
    if islands.fragments > 1:
        gap += ASSUMED_FRAGMENT_GAP
    if not H_RANGE[0] <= h <= H_RANGE[1]:
        notes += (f"{h} inner steps between exchanges (H times staleness + 1 for bounded) is "
                  f"outside the {H_RANGE[0]}-{H_RANGE[1]} the convergence model's sources "
                  "cover; extrapolated",)
    return gap, notes


def penalty(islands: Islands, params: float, tokens: float) -> Penalty:
    """The convergence penalty of ``islands`` for a model of ``params`` parameters trained
    to synchronous training's loss at ``tokens`` tokens."""
    gap, notes = loss_gap(islands, params)
    return Penalty(gap, token_factor(gap, params, tokens), notes)


def default_tokens(params: float) -> float:
    """Chinchilla's compute-optimal token count for ``params`` parameters."""
    return CHINCHILLA_TOKENS_PER_PARAM * params
