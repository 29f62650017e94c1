"""The time of one pipeline over its micro-batches, for unequal stages.

The closed form every schedule module builds on (Narayanan et al., SC'21):
``T = sum_i (f_i + b_i) + (m - 1) * max_i (f_i + b_i)``, written as ``m``
periods of the busiest stage (or link) plus the fill: the work of the other
stages, which interleaving divides by the chunks per device ``v``; zero
bubble (Qi et al. 2024, ZB-H1) takes the deferred weight gradients out of the
fill. A schedule whose ranks block on their transfers waits for them on every
micro-batch (:func:`with_blocking_transfers`); otherwise only the fill pays
them once. This matches the discrete-event simulator (``potluck.sim``) to
within one transfer per stage.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageWork:
    """One pipeline stage's time per micro-batch, in seconds.

    ``forward_s``/``backward_s`` include the stage's tensor-parallel
    communication; ``weight_grad_s`` is the part of the backward that a
    zero-bubble schedule can defer; ``send_s`` is the transfer of one
    micro-batch's activations to the next stage (and of gradients back).
    """

    forward_s: float
    backward_s: float
    weight_grad_s: float = 0.0
    send_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class PipelineTime:
    """The time of one pipeline's forward and backward passes over m micro-batches."""

    total_s: float
    period_s: float  # steady-state time per micro-batch (the slowest stage or link)
    fill_s: float  # warm-up and cool-down on top of m periods
    fill_transfer_s: float  # the part of the fill spent in transfers
    bottleneck_stage: int
    finish_s: tuple[float, ...]  # when each stage's last backward ends


def pipeline_time(stages: list[StageWork], micro_batches: int, *, chunks: int, blocking: bool,
                  defers_weight_grads: bool = False, serial_link: bool = False,
                  in_flight: list[float] | None = None) -> PipelineTime:
    """``m`` periods plus the fill, for a schedule that runs ``chunks`` chunks per device,
    blocks on its transfers or not, and defers weight gradients into the fill or not;
    ``serial_link``: a stage pair's activations and gradients share one in-order channel
    (sent one op at a time on one NCCL communicator), so each link carries both per
    micro-batch and chunk in turn (else each direction has its own, or they go together in
    one batch); ``in_flight``: per stage, the micro-batches a one-chunk schedule lets it
    start before their backward returns (:func:`round_trip_period_s`)."""
    v = chunks
    if blocking:
        stages = with_blocking_transfers(stages, v)
    busiest = max(range(len(stages)), key=lambda i: stages[i].total_s)
    directions = 2.0 if serial_link else 1.0
    link_period = max((s.send_s * v * directions for s in stages), default=0.0)
    period = max(stages[busiest].total_s, link_period)
    if in_flight is not None:
        period = max(period, round_trip_period_s(stages, in_flight, blocking))
    if defers_weight_grads:
        # ZB-H1: the bubble is (p-1)(F + B - W) with B the input-gradient half of the
        # backward, i.e. (f + b - 2w) in terms of the whole backward b.
        work = sum(s.total_s - 2.0 * s.weight_grad_s for s in stages)
        fill = max(0.0, work - (period - 2.0 * stages[busiest].weight_grad_s)) / v
    else:
        work = sum(s.total_s for s in stages)
        fill = max(0.0, work - period) / v
    fill_transfer = 0.0 if blocking else 2.0 * sum(s.send_s for s in stages[:-1])
    total = micro_batches * period + fill + fill_transfer
    finish = _stage_finish_times(stages, total)
    return PipelineTime(total, period, fill + fill_transfer, fill_transfer, busiest, finish)


def round_trip_period_s(stages: list[StageWork], in_flight: list[float], blocking: bool
                        ) -> float:
    """The period the round trips allow: a micro-batch's forward on stage ``i`` returns as
    its gradient only after the later stages' forwards and backwards and the transfers
    both ways, and meanwhile stage ``i`` runs only ``in_flight[i]`` micro-batches (under
    1F1B ``p - i``), so the period is at least that round trip over ``in_flight[i]``.
    Long transfers on slow links make this the bound, which ``m`` periods of the busiest
    stage alone would miss. Blocking stages already hold their transfers in their times."""
    period, trip = 0.0, 0.0
    for i in reversed(range(len(stages))):
        trip += stages[i].total_s
        if not blocking and i < len(stages) - 1:
            trip += 2.0 * stages[i].send_s
        period = max(period, trip / max(in_flight[i], 1.0))
    return period


def with_blocking_transfers(stages: list[StageWork], chunks: int) -> list[StageWork]:
    """A stage that blocks on its transfers waits, per micro-batch and chunk, for the
    activation it sends on and the gradient it sends back (forward), and for the
    gradient from the next stage and the one it passes back (backward)."""
    result = []
    for i, s in enumerate(stages):
        incoming = stages[i - 1].send_s if i > 0 else 0.0
        wait = chunks * (incoming + s.send_s) / 2.0
        result.append(StageWork(s.forward_s + wait, s.backward_s + wait, s.weight_grad_s, s.send_s))
    return result


def _stage_finish_times(stages: list[StageWork], total_s: float) -> tuple[float, ...]:
    """Stage i's last backward ends before stage 0's by the backwards of stages < i."""
    finish = []
    earlier = 0.0
    for stage in stages:
        finish.append(total_s - earlier)
        earlier += stage.backward_s + stage.send_s
    return tuple(finish)
