"""Synthetic traced runs for the calibration tests: the simulator's trace of a plan on a
cluster whose true inputs are known, presented as a runtime trace of the same plan made
on a cluster that claims other inputs (the catalog's nominal cpu)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from potluck.calibrate.fit_devices import with_device
from potluck.cluster.spec import parse_cluster
from potluck.model.spec import PRESETS
from potluck.plans import DType, Execution, Pipeline, Plan, Stage, TrainingShape, save_plan
from potluck.sim import simulate
from potluck.sim.trace import simulation_trace
from potluck.traces import Trace, write_trace

CLUSTER_TEXT = "name: lab\nnodes:\n  - {name: cpu, gpu: cpu, gpus_per_node: 4}\n"
CLAIMED = parse_cluster(CLUSTER_TEXT, "lab.yaml")  # the catalog's cpu: efficiency 0.8, 5 GB/s
TRUE_EFFICIENCY = 0.3
TRUE_MEMORY_BANDWIDTH = 12e9
TRUE_LINK_BANDWIDTH = 0.8e9
MODEL = replace(PRESETS["tiny-llama"], hidden_size=256, ffn_hidden_size=688, num_heads=4,
                num_kv_heads=4, num_layers=4)


def true_cluster(link_bandwidth: float = TRUE_LINK_BANDWIDTH):
    spec = with_device(CLAIMED, "cpu", TRUE_EFFICIENCY, TRUE_MEMORY_BANDWIDTH)
    group = replace(spec.nodes[0], intra_bandwidth_bytes_per_s=link_bandwidth)
    return replace(spec, nodes=(group,))


def plan_on(spec, dp: int, pp: int, overlap: bool = False) -> Plan:
    """``dp`` pipelines of ``pp`` one-device stages, two micro-batches of 2 sequences each;
    the gradient all-reduce after the backward pass unless ``overlap``."""
    layers = MODEL.num_layers // pp
    pipelines = tuple(
        Pipeline(tuple(Stage((f"cpu.0:{k * pp + i}",), ((i * layers, (i + 1) * layers),))
                       for i in range(pp)), 2, 2) for k in range(dp))
    shape = TrainingShape(4 * dp, 128, DType.BF16, Execution(overlap_grad_reduce=overlap))
    return Plan(cluster=spec, model=MODEL, training=shape, pipelines=pipelines)


def _exposed(events: list) -> list:
    """The runtime's view of overlapped all-reduces: each rank waits only for what is left
    after its own last backward."""
    last = {}
    for e in events:
        if e.kind == "backward":
            last[e.device] = max(last.get(e.device, 0.0), e.end_s)
    return [e if e.kind != "dp_allreduce" else
            replace(e, start_s=max(e.start_s, last[e.device]),
                    duration_s=max(0.0, e.end_s - max(e.start_s, last[e.device])))
            for e in events]


def synthetic_run(run_dir: Path, dp: int, pp: int, steps: int = 3, overlap: bool = False,
                  link_bandwidth: float = TRUE_LINK_BANDWIDTH) -> Path:
    """A run directory: the plan on the claimed cluster, the trace of the true one."""
    run_dir.mkdir(parents=True, exist_ok=True)
    simulated = simulation_trace(simulate(plan_on(true_cluster(link_bandwidth), dp, pp, overlap)))
    once = _exposed(simulated.events) if overlap else simulated.events
    step_s = max(e.end_s for e in once)
    events = [replace(e, start_s=e.start_s + k * 2 * step_s, step=k)
              for k in range(steps) for e in once]
    write_trace(Trace(simulated.devices, events, metadata={"source": "runtime"}),
                run_dir / "trace.json")
    save_plan(plan_on(CLAIMED, dp, pp, overlap), run_dir / "plan.json")
    return run_dir
