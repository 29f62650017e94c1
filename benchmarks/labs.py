"""Realistic labs of 5-16 distinct machines, shared by the lab benchmarks and tests.

Each lab is what a group without a datacenter has: boxes and desktops that each differ
(consumer, workstation and datacenter GPUs), boxes on 10-100 Gb/s, desktops on 1 Gb/s,
sometimes a rented machine behind a slow link; each with a model from 1B to 13B
parameters (dense and a mixture of experts) and a batch such a lab would train with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from potluck.examples import example_path


@dataclass(frozen=True)
class Lab:
    name: str
    cluster: str  # cluster file text
    model: str | dict[str, Any]  # a preset name or a config.json as a dict
    global_batch: int
    seq_len: int

    @property
    def model_name(self) -> str:
        return self.model if isinstance(self.model, str) else self.model["name"]


# A mixture of experts a lab can train: Mixtral's shape at 4.6B parameters, 1.4B active.
SMALL_MOE = {"name": "moe-4.6b", "model_type": "mixtral", "hidden_size": 2048,
             "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 16,
             "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
             "vocab_size": 32000, "max_position_embeddings": 4096}

LABS = [
    Lab("issue 29's lab: 2x4 RTX 3090 (pairs), 2 RTX 4090, 4 A100 PCIe, 3060, 2080 Ti",
        example_path("five-machines.yaml").read_text(), "llama2-13b", 128, 4096),
    Lab("student lab: six desktops on 1 Gb/s, a 2x3090 box on 10 Gb/s", """
nodes:
  - {name: d3090, gpu: rtx3090, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: d4090, gpu: rtx4090, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: d3080, gpu: rtx3080, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: d3060, gpu: rtx3060, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: d2080ti, gpu: rtx2080ti, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: d4070ti, gpu: rtx4070ti, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: box, gpu: rtx3090, gpus_per_node: 2, nvlink: pairs, inter_bandwidth: 10Gb/s}
""", "llama3.2-1b", 64, 2048),
    Lab("workstations: 4 A6000 (pairs), 2 L40S, 4 A5000 (pairs), a 4090 and a 3090 desktop", """
nodes:
  - {name: ws-a6000, gpu: rtx-a6000, gpus_per_node: 4, nvlink: pairs, inter_bandwidth: 25Gb/s}
  - {name: ws-l40s, gpu: l40s, gpus_per_node: 2, inter_bandwidth: 25Gb/s}
  - {name: ws-a5000, gpu: rtx-a5000, gpus_per_node: 4, nvlink: pairs, inter_bandwidth: 10Gb/s}
  - {name: desk4090, gpu: rtx4090, gpus_per_node: 1, inter_bandwidth: 10Gb/s}
  - {name: desk3090, gpu: rtx3090, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
""", "llama2-7b", 128, 4096),
    Lab("rented and owned: 2 A100 SXM in a cloud (1 Gb/s to the lab), 4 RTX 4090, "
        "2 RTX 3090 (pair), a 4080 and a 3080 desktop", """
nodes:
  - {name: cloud, gpu: a100-80g-sxm, gpus_per_node: 2, inter_bandwidth: 100Gb/s}
  - {name: box4090, gpu: rtx4090, gpus_per_node: 4, inter_bandwidth: 10Gb/s}
  - {name: box3090, gpu: rtx3090, gpus_per_node: 2, nvlink: pairs, inter_bandwidth: 10Gb/s}
  - {name: desk4080, gpu: rtx4080, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: desk3080, gpu: rtx3080, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
links:
  - {between: [cloud, box4090], bandwidth: 1Gb/s, latency: 20ms}
  - {between: [cloud, box3090], bandwidth: 1Gb/s, latency: 20ms}
  - {between: [cloud, desk4080], bandwidth: 1Gb/s, latency: 20ms}
  - {between: [cloud, desk3080], bandwidth: 1Gb/s, latency: 20ms}
""", "llama3.2-3b", 64, 4096),
    Lab("mixture of experts: 8 V100 (NVLink), 4 L4, 2 A10, 4 RTX 3090 (pairs), a 4090", """
nodes:
  - {name: v100, gpu: v100-32g, gpus_per_node: 8, inter_bandwidth: 25Gb/s}
  - {name: l4, gpu: l4, gpus_per_node: 4, inter_bandwidth: 25Gb/s}
  - {name: a10, gpu: a10, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
  - {name: r3090, gpu: rtx3090, gpus_per_node: 4, nvlink: pairs, inter_bandwidth: 10Gb/s}
  - {name: d4090, gpu: rtx4090, gpus_per_node: 1, inter_bandwidth: 10Gb/s}
""", SMALL_MOE, 128, 2048),
    Lab("datacenter leftovers: 8 V100, 4 T4, 2 A10, 4 L4, an A40", """
nodes:
  - {name: v100, gpu: v100-32g, gpus_per_node: 8, inter_bandwidth: 25Gb/s}
  - {name: t4, gpu: t4, gpus_per_node: 4, inter_bandwidth: 10Gb/s}
  - {name: a10, gpu: a10, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
  - {name: l4, gpu: l4, gpus_per_node: 4, inter_bandwidth: 25Gb/s}
  - {name: a40, gpu: a40, gpus_per_node: 1, inter_bandwidth: 10Gb/s}
""", "gpt3-2.7b", 256, 2048),
    Lab("gaming cafe: ten single-GPU desktops on 1 Gb/s, a 4x4090 box on 10 Gb/s", """
nodes:
  - {name: c5090, gpu: rtx5090, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: c4090, gpu: rtx4090, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: c4080, gpu: rtx4080, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: c4070ti, gpu: rtx4070ti, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: c3090ti, gpu: rtx3090ti, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: c3090, gpu: rtx3090, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: c3080ti, gpu: rtx3080ti, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: c3080, gpu: rtx3080, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: c3060, gpu: rtx3060, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: c2080ti, gpu: rtx2080ti, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: box4090, gpu: rtx4090, gpus_per_node: 4, inter_bandwidth: 10Gb/s}
""", "llama3.2-3b", 64, 2048),
    Lab("sixteen distinct machines, 1-100 Gb/s", """
nodes:
  - {name: m3090x4, gpu: rtx3090, gpus_per_node: 4, nvlink: pairs, inter_bandwidth: 10Gb/s}
  - {name: m4090x2, gpu: rtx4090, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
  - {name: ma100x4, gpu: a100-40g-pcie, gpus_per_node: 4, inter_bandwidth: 100Gb/s}
  - {name: m3060, gpu: rtx3060, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: m2080ti, gpu: rtx2080ti, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: ma6000x2, gpu: rtx-a6000, gpus_per_node: 2, nvlink: pairs, inter_bandwidth: 25Gb/s}
  - {name: ml40sx4, gpu: l40s, gpus_per_node: 4, inter_bandwidth: 25Gb/s}
  - {name: m3080, gpu: rtx3080, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: mv100x8, gpu: v100-32g, gpus_per_node: 8, inter_bandwidth: 25Gb/s}
  - {name: mt4x4, gpu: t4, gpus_per_node: 4, inter_bandwidth: 10Gb/s}
  - {name: ma10x2, gpu: a10, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
  - {name: m4080, gpu: rtx4080, gpus_per_node: 1, inter_bandwidth: 1Gb/s}
  - {name: ma5000x4, gpu: rtx-a5000, gpus_per_node: 4, nvlink: pairs, inter_bandwidth: 10Gb/s}
  - {name: mh100x2, gpu: h100-pcie, gpus_per_node: 2, inter_bandwidth: 100Gb/s}
  - {name: ml4x4, gpu: l4, gpus_per_node: 4, inter_bandwidth: 25Gb/s}
  - {name: m5090x2, gpu: rtx5090, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
""", "llama2-13b", 256, 4096),
]
