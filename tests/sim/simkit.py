"""Plans, clusters and synthetic workloads for the simulator's tests."""

from __future__ import annotations

from potluck.cluster.spec import ClusterSpec, parse_cluster
from potluck.cluster.topology import Cluster
from potluck.model.spec import MlpKind, ModelSpec
from potluck.plans import Pipeline, Plan, Schedule, Stage, TrainingShape
from potluck.sim.network import Network
from potluck.sim.workload import ChunkWork, PipelineWorkload, StageWorkload

# Four 8-GPU boxes whose links are so fast and close that transfers take no time.
INSTANT_LINKS = """
name: instant
nodes:
  - name: box
    gpu: a100-80g-sxm
    gpus_per_node: 8
    count: 4
    nvlink_bandwidth: 1000000GB/s
    intra_latency: 0s
    inter_latency: 0s
    inter_bandwidth: 1000000GB/s
"""

# Two 4090 boxes on 10 Gb/s Ethernet, 4 GPUs each on PCIe.
SLOW_NETWORK = """
name: slow
nodes:
  - name: box
    gpu: rtx4090
    gpus_per_node: 4
    count: 4
    inter_bandwidth: 10Gb/s
"""


def cluster(text: str = INSTANT_LINKS) -> ClusterSpec:
    return parse_cluster(text, "test-cluster.yaml")


def flat_model(layers: int = 8, hidden: int = 1024) -> ModelSpec:
    """A model whose head costs next to nothing, so all stages of an even split are equal."""
    return ModelSpec(name="flat", family="llama", hidden_size=hidden, num_layers=layers,
                     num_heads=8, num_kv_heads=8, ffn_hidden_size=4 * hidden, vocab_size=8,
                     max_seq_len=1024, mlp=MlpKind.GELU)


def make_plan(spec: ClusterSpec, model: ModelSpec, pp: int, micro_batches: int, *, tp: int = 1,
              dp: int = 1, schedule: Schedule = Schedule.ONE_F_ONE_B, virtual_stages: int = 1,
              micro_batch_size: int = 1, seq_len: int = 1024, zero1: bool = False,
              devices: list[str] | None = None) -> Plan:
    """An even split of ``model`` over ``dp`` pipelines of ``pp`` stages of ``tp`` devices."""
    ids = devices or [d.id for d in Cluster(spec).devices]
    chunks = pp * virtual_stages
    per_chunk = model.num_layers // chunks
    pipelines = []
    for k in range(dp):
        stages = []
        for i in range(pp):
            start = (k * pp + i) * tp
            ranges = tuple(((c * pp + i) * per_chunk, (c * pp + i + 1) * per_chunk)
                           for c in range(virtual_stages))
            stages.append(Stage(tuple(ids[start:start + tp]), ranges))
        pipelines.append(Pipeline(tuple(stages), micro_batch_size, micro_batches))
    shape = TrainingShape(global_batch=dp * micro_batches * micro_batch_size, seq_len=seq_len)
    return Plan(cluster=spec, model=model, training=shape, pipelines=tuple(pipelines),
                schedule=schedule, virtual_stages=virtual_stages, zero=int(zero1))


def synthetic_pipeline(stages: int, micro_batches: int, virtual_stages: int = 1,
                       forward_s: float = 1.0, backward_s: float = 2.0, weight_grad_s: float = 0.0,
                       index: int = 0, send_bytes: float = 0.0,
                       activation_bytes: float = 1.0) -> tuple[PipelineWorkload, Network]:
    """Identical stages with round op times on one device each; transfers take no time."""
    network = Network(Cluster(cluster()))
    v = virtual_stages
    chunk = ChunkWork(forward_s / v, 0.0, backward_s / v, 0.0, weight_grad_s / v,
                      activation_bytes, 0.0)
    devices = network.cluster.devices
    work = tuple(
        StageWorkload((devices[index * stages + i],), (chunk,) * v, 0.0, 0.0, send_bytes)
        for i in range(stages)
    )
    return PipelineWorkload(index, work, micro_batches), network
