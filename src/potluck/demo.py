"""``potluck demo``: plan the built-in mixed cluster and compare with the even split.

Needs no downloads and no GPU: the cluster file ships with the package.
"""

from __future__ import annotations

from dataclasses import dataclass

from potluck import api
from potluck.examples import example_path
from potluck.plans import Plan

DEMO_MODEL = "llama2-7b"
DEMO_GLOBAL_BATCH = 64
DEMO_SEQ_LEN = 4096


@dataclass(frozen=True)
class DemoOutcome:
    cluster: str
    model: str
    balanced: Plan
    uniform: Plan

    @property
    def speedup(self) -> float:
        return self.uniform.prediction.iteration_time_s / self.balanced.prediction.iteration_time_s


def run_demo() -> DemoOutcome:
    cluster = example_path("mixed.yaml")
    shape = {"global_batch": DEMO_GLOBAL_BATCH, "seq_len": DEMO_SEQ_LEN}
    balanced = api.plan(cluster, DEMO_MODEL, **shape).best
    uniform = api.plan(cluster, DEMO_MODEL, partition="uniform", **shape).best
    return DemoOutcome(balanced.cluster.name, DEMO_MODEL, balanced, uniform)
