"""How long a survivor blocked in a wait that never raises (as under NCCL) takes to stop
when a rank on another machine dies, under torchrun.

    python benchmarks/failure_detection.py [--trials 3] [--silence-s 3]

Two torchrun "machines" run side by side on this one (``--master-addr 127.0.0.1``), one
rank each, with a two-stage plan. The rank on the second machine kills itself once the
job has started; rank 0 blocks in a store wait, as an NCCL survivor blocks in a host
sync. The time printed is from the second machine's torchrun agent ending to rank 0's
agent ending: the silence before rank 0's watcher names the dead rank
(``POTLUCK_SILENCE_S``), then the main thread's ``NOTICE_S`` to meet it, then the abort.
The ranks are ``tests/runtime/launch/blocking_rank.py``, the scenario of
``test_watchdog``'s torchrun test. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RANK_SCRIPT = REPO / "tests" / "runtime" / "launch" / "blocking_rank.py"
BOUND_S = 300.0
CLUSTER = ("nodes:\n  - name: big\n    gpu: cpu\n    gpus_per_node: 1\n"
           "  - name: small\n    gpu: cpu\n    gpus_per_node: 1\n")


def two_machine_plan(folder: Path) -> Path:
    """A tiny llama in two stages, one on each machine; its plan file."""
    from potluck import api
    from potluck.cluster.spec import parse_cluster
    from potluck.plans import save_plan

    cluster = parse_cluster(CLUSTER, "two.yaml")
    plan = api.plan(cluster, "tiny-llama", global_batch=2, seq_len=16, dtype="fp32", tp=1,
                    pp=2, dp=1, micro_batch_size=1).best
    path = folder / "plan.json"
    save_plan(plan, path)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_trial(plan: Path, silence_s: float) -> float:
    """Seconds from the dead machine's agent ending to rank 0's agent ending."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "POTLUCK_SILENCE_S": str(silence_s),
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(RANK_SCRIPT.parent)])}
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}",
         "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
         str(RANK_SCRIPT), str(plan), "1"],
        env={**env, "POTLUCK_NODE": node}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for rank, node in enumerate(["big.0", "small.0"])]
    try:
        agents[1].wait(timeout=BOUND_S)
        dead_at = time.monotonic()
        agents[0].wait(timeout=BOUND_S)
        return time.monotonic() - dead_at
    finally:
        for agent in agents:
            agent.kill()
            agent.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--silence-s", type=float, default=3.0)
    args = parser.parse_args()
    print(f"{args.trials} trials of about {args.silence_s + 20:.0f} s each", file=sys.stderr)
    with tempfile.TemporaryDirectory() as folder:
        plan = two_machine_plan(Path(folder))
        times = []
        for trial in range(args.trials):
            times.append(one_trial(plan, args.silence_s))
            print(f"trial {trial + 1}/{args.trials}: {times[-1]:.1f} s", file=sys.stderr)
    print("| POTLUCK_SILENCE_S | trials | survivor stopped after (s) |")
    print("|---|---|---|")
    print(f"| {args.silence_s:g} | {args.trials} | "
          f"{min(times):.1f}-{max(times):.1f} (median {sorted(times)[len(times) // 2]:.1f}) |")


if __name__ == "__main__":
    main()
