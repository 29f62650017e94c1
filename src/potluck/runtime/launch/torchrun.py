"""One ``torchrun`` command per machine, for a plan that spans several.

:func:`torchrun_commands` gives the command for each machine of a plan;
machines with different GPU counts get different ``--nproc-per-node``
(torchrun numbers ranks per node, potluck maps them to devices through
``POTLUCK_NODE`` and ``LOCAL_RANK``). Each command exports
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` to torchrun and so to its ranks: CUDA reads it
once, when first used, so a rank's import that touches CUDA before potluck
could otherwise number a mixed machine's GPUs fastest first, not as the cluster
file (nvidia-smi) does. Each command runs
``python -m potluck.runtime.worker`` on every rank of its machine;
:func:`torchrun_rank_order` says which device each global rank then runs (not
always the plan's device order: a pipeline may leave a machine and come back).
Every value is quoted for the shell (``shlex.quote``): a path with a space stays
one word, and a value from a plan file cannot add a command.
"""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from potluck.cluster.topology import Cluster
from potluck.plans import Plan, plan_to_json
from potluck.runtime.launch.gpus import DEVICE_ORDER
from potluck.units import port_number


@dataclass(frozen=True)
class NodeCommand:
    """What to run on one machine of a multi-machine plan."""

    node: str
    node_rank: int
    nproc: int
    command: str


def plan_nodes(plan: Plan) -> list[tuple[str, int]]:
    """``(machine id, ranks on it)`` for every machine the plan uses, in plan order."""
    cluster = Cluster(plan.cluster)
    counts: dict[str, int] = {}
    for device_id in plan.devices:
        node = cluster.device(device_id).node
        counts[node] = counts.get(node, 0) + 1
    return list(counts.items())


def torchrun_commands(plan: Plan, plan_path: str, master_addr: str, master_port: int = 29500,
                      worker_args: Sequence[str] = (), max_restarts: int | None = None
                      ) -> list[NodeCommand]:
    """One ``torchrun`` command per machine; run them all (any order) to start the job.
    With ``max_restarts`` (an elastic run) the machines meet through torchrun's c10d
    rendezvous at ``master_addr:master_port``, any number of them from one up, and the
    agents restart the ranks up to that many times (:mod:`potluck.runtime.elastic.rendezvous`)."""
    port_number(master_port, "--master-port")
    nodes = plan_nodes(plan)
    commands = []
    for node_rank, (node, nproc) in enumerate(nodes):
        if max_restarts is None:
            where = [f"--nnodes={len(nodes)}", f"--node-rank={node_rank}",
                     f"--master-addr={master_addr}", f"--master-port={master_port}"]
        else:
            where = [f"--nnodes=1:{len(nodes)}", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={master_addr}:{master_port}",
                     f"--rdzv-id={_run_id(plan)}", f"--max-restarts={max_restarts}"]
        parts = [
            "torchrun", *where, f"--nproc-per-node={nproc}",
            "-m", "potluck.runtime.worker", "--plan", plan_path, *worker_args,
        ]
        env = [f"POTLUCK_NODE={shlex.quote(node)}", "=".join(DEVICE_ORDER)]
        words = [*env, *(shlex.quote(str(p)) for p in parts)]
        commands.append(NodeCommand(node, node_rank, nproc, " ".join(words)))
    return commands


def _run_id(plan: Plan) -> str:
    """The rendezvous id of an elastic run: the same on every machine for one plan."""
    digest = hashlib.sha256(plan_to_json(plan).encode()).hexdigest()
    return f"potluck-{digest[:12]}"


def node_devices(plan: Plan, node: str) -> tuple[str, ...]:
    """The plan's devices on machine ``node`` by ``LOCAL_RANK``: in local-index order (how
    :func:`potluck.runtime.launch.session.local_device_id` maps a torchrun rank)."""
    cluster = Cluster(plan.cluster)
    on_node = [cluster.device(d) for d in plan.devices if cluster.device(d).node == node]
    return tuple(d.id for d in sorted(on_node, key=lambda d: d.local_index))


def torchrun_rank_order(plan: Plan) -> tuple[str, ...]:
    """The device of each global rank the commands of :func:`torchrun_commands` start:
    torchrun numbers ranks machine by machine (``--node-rank`` order, then ``LOCAL_RANK``)."""
    return tuple(d for node, _ in plan_nodes(plan) for d in node_devices(plan, node))
