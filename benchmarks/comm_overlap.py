"""Communication scheduling on communication-bound clusters: speedups predicted and emulated.

Each case plans one layout twice with potluck's planner, the method forced off and forced on
(the execution section's traits), then runs both with ``--emulate`` on CPU ranks of this
machine: the tiny stand-in computes, every op is stretched to the plan's device time, and
the communication each method overlaps runs beside the compute on its emulated channel
(``potluck.runtime.timing``), so what overlaps is what the runtime's own order of ops lets
overlap. Both plans of a case share one dilation (the larger of their calibrations), so their
measured steps compare. The ``planner`` cases plan a whole cluster without pins, every method
off against every method left to the search.

Clusters: one machine of four RTX 3090 on PCIe without NVLink (``box``); two such machines
on a 10 Gb/s network (``boxes``); eight one-GPU RTX 3090 desktops on a 10 Gb/s network
(``desks``: every pipeline stage on its own machine).

Prints a table (the plans, their predicted steps and speedup, the simulated and the measured
speedup, each plan's emulated step against its prediction; progress goes to stderr) and
writes, per case, ``docs/img/comm_<case>.png``: the simulated iterations before and
after on one time axis.

    python benchmarks/comm_overlap.py [--steps 3] [--cases tp,keeps,pipeline,dp,planner-boxes]
                                      [--predicted-only]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from potluck import api
from potluck.cluster.execution import COMM_OFF, Execution
from potluck.cluster.spec import parse_cluster
from potluck.plans import Plan
from potluck.runtime.options import TrainOptions
from potluck.runtime.training import train
from potluck.sim import simulate
from potluck.sim.timeline import write_timelines

BOX = "nodes:\n  - {name: box, gpu: rtx3090, gpus_per_node: 4, nvlink: none}\n"
BOXES = ("nodes:\n  - {name: box, gpu: rtx3090, gpus_per_node: 4, count: 2, nvlink: none, "
         "inter_bandwidth: 10Gb/s}\n")
DESKS = ("nodes:\n  - {name: desk, gpu: rtx3090, gpus_per_node: 1, count: 8, "
         "inter_bandwidth: 10Gb/s}\n")
OFF = Execution(**COMM_OFF)
IMAGES = Path(__file__).resolve().parents[1] / "docs" / "img"


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    cluster: str
    model: str
    shape: dict
    on: Execution  # the method forced on (OFF with it switched on), or auto for the planner


CASES = [
    Case("tp", "TP overlap, 2 sub-batches (Oases)", BOX, "gpt3-1.3b",
         {"global_batch": 8, "seq_len": 2048, "tp": 4, "pp": 1, "micro_batch_size": 2},
         replace(OFF, tp_overlap_chunks=2)),
    Case("keeps", "recomputation keeping communication (Oases)", BOX, "gpt3-1.3b",
         {"global_batch": 8, "seq_len": 2048, "tp": 4, "pp": 1, "micro_batch_size": 1,
          "recompute": "full"},
         replace(OFF, recompute_keeps_comm=True)),
    Case("pipeline", "split pipeline channels (TriRace)", DESKS, "gpt3-1.3b",
         {"global_batch": 32, "seq_len": 2048, "tp": 1, "pp": 8, "micro_batch_size": 1},
         replace(OFF, split_p2p_channels=True)),
    Case("dp", "split channels + data-parallel priority, ZeRO-1 (TriRace)", DESKS, "gpt3-1.3b",
         {"global_batch": 32, "seq_len": 2048, "tp": 1, "pp": 4, "dp": 2,
          "micro_batch_size": 1, "zero": 1},
         replace(OFF, split_p2p_channels=True, dp_priority_schedule=True)),
    Case("planner-boxes", "the planner: every method off, against where each pays", BOXES,
         "gpt3-1.3b", {"global_batch": 32, "seq_len": 2048}, Execution()),
    Case("planner-desks", "the planner: every method off, against where each pays", DESKS,
         "gpt3-1.3b", {"global_batch": 32, "seq_len": 2048}, Execution()),
]


def plans_of(case: Case) -> dict[str, Plan]:
    cluster = parse_cluster(case.cluster, f"{case.name}.yaml")
    return {name: api.plan(cluster, case.model, execution=execution, **case.shape).best
            for name, execution in (("off", OFF), ("on", case.on))}


def emulated(plan: Plan, steps: int, dilation: float | None) -> tuple[float, float, float]:
    """Median measured step (the first one timed warms up), the dilated prediction and the
    dilation."""
    options = TrainOptions(steps=steps, emulate=True, stand_in="tiny", dilation=dilation,
                           progress=False, timeout_s=1800)
    history = train(plan, options)
    timed = history[1:] or history
    measured = sorted(m.step_time_s for m in timed)[len(timed) // 2]
    return measured, history[-1].predicted_step_time_s, history[-1].dilation


def describe(plan: Plan) -> str:
    stages = sorted({(s.comm.tp_overlap_chunks, s.comm.recompute_keeps_comm)
                     for p in plan.pipelines for s in p.stages if s.tp > 1})
    methods = [name for name, on in vars(plan.comm).items() if on]
    methods += [f"tp chunks {c}" + (" keeps" if k else "") for c, k in stages if c > 1 or k]
    micro = plan.pipelines[0].micro_batch_size
    return f"{plan.layout()} mb{micro} {plan.schedule.value} [{', '.join(methods) or 'plain'}]"


def run_case(case: Case, steps: int, emulate: bool = True) -> str:
    """The case's table row; progress on stderr."""
    began = time.perf_counter()
    plans = plans_of(case)
    note(f"{case.name}: {case.what}; {case.model}")
    pictures = [(f"{name} ({describe(plan)})", simulate(plan)) for name, plan in plans.items()]
    write_timelines(pictures, IMAGES / f"comm_{case.name}.png")
    predicted = {name: plan.prediction.iteration_time_s for name, plan in plans.items()}
    speedup = predicted["off"] / predicted["on"]
    simulated = pictures[0][1].iteration_time_s / pictures[1][1].iteration_time_s
    row = (f"| {case.name} | {case.what} | {describe(plans['off'])} | {describe(plans['on'])} "
           f"| {predicted['off']:.3f} / {predicted['on']:.3f} s | {speedup:.3f}x "
           f"| {simulated:.3f}x")
    if not emulate:
        return row + " | | |"
    dilation = max(emulated(plan, 1, None)[2] for plan in plans.values())
    measured, errors = {}, []
    for name, plan in plans.items():
        step_s, predicted_s, _ = emulated(plan, steps, dilation)
        measured[name] = step_s
        errors.append(f"{step_s / predicted_s - 1:+.1%}")
        note(f"  {name} emulated {step_s:.2f} s, predicted {predicted_s:.2f} s (dilation "
             f"{dilation:.1f})")
    note(f"  ({time.perf_counter() - began:.0f} s)")
    return row + f" | {measured['off'] / measured['on']:.3f}x | {' / '.join(errors)} |"


def note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


HEADER = ("| case | method | off | on | predicted step (off / on) | predicted speedup "
          "| simulated | measured (emulated) | emulated / predicted - 1 (off / on) |\n"
          "|---|---|---|---|---:|---:|---:|---:|---:|")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    parser.add_argument("--predicted-only", action="store_true",
                        help="plan, predict and simulate only (seconds, not an hour)")
    args = parser.parse_args()
    wanted = args.cases.split(",")
    rows = [run_case(case, args.steps, emulate=not args.predicted_only)
            for case in CASES if case.name in wanted]
    print("\n".join([HEADER, *rows]))


if __name__ == "__main__":
    main()
