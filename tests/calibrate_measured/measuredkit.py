"""Synthetic measured runs: iteration times potluck predicts on a cluster whose true
inputs are known (efficiency, network bandwidth, overheads, the host's time per block),
written as a runs CSV for a cluster file that claims the catalog's figures.

The model is large enough that every layout's blocks take longer on the GPUs than the
host takes to issue them (``Execution.block_host_s``'s default, 192 us; the shortest
forward here is ~0.46 ms at the true efficiency, ~0.27 ms at the claimed one): the runs
are GPU-bound unless a test sets a longer host time."""

from __future__ import annotations

from pathlib import Path

from potluck.calibrate.measured.runs import MeasuredRun
from potluck.cluster.spec import parse_cluster
from potluck.model.spec import PRESETS
from potluck.planner.search import search
from potluck.plans import Execution

MODEL_NAME = "gpt3-2.7b"
MODEL = PRESETS[MODEL_NAME]
CLAIMED_TEXT = """name: lab
# two machines of two A100s, joined by a slow network
nodes:
  - {name: a, gpu: a100-80g-sxm, gpus_per_node: 2, count: 2, inter_bandwidth: 10Gb/s}
"""
TRUE_EFFICIENCY = 0.5  # the catalog claims 0.87
TRUE_NETWORK_FACTOR = 0.4  # 4 Gb/s of the 10 claimed
TRUE_MICRO_BATCH_OVERHEAD_S = 0.003
HOST_BOUND_BLOCK_S = 2e-3  # the host issues a block's forward in 2 ms (a slow framework)
HEADER = "tp,pp,dp,micro_batch_size,global_batch,seq_len,iteration_time_s"
LAYOUTS = (  # tp, pp, dp, micro-batch size, global batch, sequence length
    (1, 1, 4, 2, 32, 512), (2, 1, 2, 2, 32, 512), (1, 2, 2, 1, 16, 512), (2, 2, 1, 1, 8, 512),
    (1, 1, 2, 4, 32, 256), (1, 4, 1, 2, 16, 512), (1, 1, 4, 1, 16, 1024), (2, 1, 2, 1, 8, 1024),
)


def true_cluster_text(efficiency: float = TRUE_EFFICIENCY,
                      network_factor: float = TRUE_NETWORK_FACTOR) -> str:
    return CLAIMED_TEXT + (
        f"calibration:\n  devices:\n    a100-80g-sxm: {{matmul_efficiency: {efficiency!r}}}\n"
        f"  links:\n    - {{kind: network, groups: [a], bandwidth: {10 * network_factor!r}Gb/s}}\n")


def true_times(layouts=LAYOUTS, overhead_s: float = TRUE_MICRO_BATCH_OVERHEAD_S,
               cluster_text: str | None = None,
               block_host_s: float = Execution.block_host_s) -> list[float]:
    """Each layout's iteration time on the true cluster, as potluck's planner predicts it."""
    spec = parse_cluster(cluster_text or true_cluster_text(), "true.yaml")
    execution = Execution(micro_batch_overhead_s=overhead_s, block_host_s=block_host_s)
    times = []
    for layout in layouts:
        run = MeasuredRun(0, *layout, 1.0)
        times.append(search(spec, MODEL, run.shape(execution), run.options()).best
                     .prediction.iteration_time_s)
    return times


def write_runs(path: Path, times: list[float], layouts=LAYOUTS) -> Path:
    lines = [HEADER] + [",".join(map(str, layout)) + f",{t!r}"
                        for layout, t in zip(layouts, times, strict=True)]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_claimed(path: Path) -> Path:
    path.write_text(CLAIMED_TEXT)
    return path


# Host-bound runs (HOST_BOUND_BLOCK_S): micro-batches of one sequence of 512 tokens run at
# the host's pace (forward 0.46-0.93 ms on the GPUs), those of four of 1,024 tokens
# (3.7-6.5 ms) at the GPUs'; global batches from 16 to 64 sequences, so that the host's
# time per iteration differs from run to run
HOST_BOUND_LAYOUTS = (
    (1, 1, 4, 1, 64, 512), (1, 1, 4, 1, 16, 512), (2, 1, 2, 1, 32, 512), (1, 2, 2, 1, 64, 512),
    (1, 1, 4, 4, 64, 1024), (1, 1, 4, 4, 16, 1024), (2, 1, 2, 4, 32, 1024),
    (1, 2, 2, 4, 64, 1024), (1, 1, 4, 2, 32, 512), (2, 2, 1, 2, 16, 1024),
)
