"""The profiler measures this machine and writes a cluster file the planner reads."""

from __future__ import annotations

import pytest
import torch

from potluck.cluster.spec import load_cluster, parse_cluster
from potluck.errors import ConfigError
from potluck.model.loading import load_model
from potluck.planner.formulas import MEMORY_BANDWIDTH_EFFICIENCY
from potluck.planner.gemm import achievable_flops
from potluck.plans import DType
from potluck.profiler import ProfileOptions, profile
from potluck.profiler.calibration_file import (
    calibrated_text,
    device_type_name,
    profiled_cluster_text,
)
from potluck.profiler.comm import AllReduceMeasurement, PairMeasurement
from potluck.profiler.compute import DeviceMeasurement, measure_device
from potluck.profiler.run import ProfileResult


def _result(flops_fp32: float = 0.1e12, bandwidth: float = 16e9) -> ProfileResult:
    devices = [DeviceMeasurement("cpu", {"fp32": flops_fp32, "bf16": 0.3e12}, bandwidth)] * 2
    return ProfileResult(["hostA", "hostA"], devices,
                         [PairMeasurement(1, True, 3e9, 50e-6)],
                         AllReduceMeasurement(2, 16e6, 0.01))


def test_measures_matmul_throughput_and_memory_bandwidth_on_cpu() -> None:
    measured = measure_device(torch.device("cpu"), load_model("tiny-llama"), ["fp32"], 0.05)
    assert measured.device_name == "cpu"
    assert 1e8 < measured.matmul_flops["fp32"] < 1e14
    assert 1e8 < measured.memory_bandwidth_bytes_per_s < 1e13


def test_profiled_file_describes_the_hosts_and_calibrates_the_cost_model_inputs(tmp_path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(profiled_cluster_text(_result(), "cpu"))
    spec = load_cluster(path)
    assert [(g.name, g.gpu, g.gpus_per_node) for g in spec.nodes] == [("hosta", "cpu", 2)]
    cpu = spec.device_type("cpu")
    assert achievable_flops(cpu, DType.FP32) == pytest.approx(0.1e12, rel=1e-3)  # measured FP32 FLOP/s
    assert cpu.memory_bandwidth_bytes_per_s * MEMORY_BANDWIDTH_EFFICIENCY == pytest.approx(
        16e9, rel=1e-3)
    assert spec.nodes[0].intra_bandwidth_bytes_per_s == pytest.approx(3e9, rel=1e-3)
    assert spec.nodes[0].intra_latency_s == pytest.approx(50e-6, rel=1e-3)


CLUSTER = """# my lab
name: lab
nodes:
  - name: cpus
    gpu: cpu
    gpus_per_node: 4
calibration:
  devices:
    cpu: {matmul_efficiency: 9.0, memory_bandwidth_factor: 3.0}
links:
  - between: [cpus, cpus]
    bandwidth: 1Gb/s
"""


def test_calibrating_a_file_replaces_only_its_calibration_section() -> None:
    text = calibrated_text(CLUSTER, parse_cluster(CLUSTER), _result(), "cpu")
    assert text.startswith("# my lab\nname: lab\n") and "between: [cpus, cpus]" in text
    assert text.count("calibration:") == 1
    spec = parse_cluster(text)
    cpu = spec.device_type("cpu")
    assert achievable_flops(cpu, DType.FP32) == pytest.approx(0.1e12, rel=1e-3)
    assert cpu.memory_bandwidth_bytes_per_s * MEMORY_BANDWIDTH_EFFICIENCY == pytest.approx(
        16e9, rel=1e-3)  # relative to the catalog, not to the old calibration
    with pytest.raises(ConfigError, match="no rtx3090 node groups"):
        calibrated_text(CLUSTER, parse_cluster(CLUSTER), _result(), "rtx3090")


@pytest.mark.parametrize(("reported", "name"), [
    ("cpu", "cpu"), ("NVIDIA GeForce RTX 3090", "rtx3090"), ("NVIDIA GeForce RTX 4090", "rtx4090")])
def test_device_names_map_to_the_catalog(reported: str, name: str) -> None:
    assert device_type_name(reported) == name


@pytest.mark.slow  # two spawned processes importing torch: about 5 s on two cores
def test_two_gloo_ranks_measure_their_link_and_all_reduce() -> None:
    options = ProfileOptions(load_model("tiny-llama"), ranks=2, budget_s=0.02, dtypes=("fp32",),
                             p2p_bytes=1e6)
    fractions: list[float] = []
    result = profile(options, lambda fraction, what: fractions.append(fraction))
    assert result.hosts[0] == result.hosts[1] and len(result.devices) == 2
    (pair,) = result.pairs
    assert pair.same_host and pair.bandwidth_bytes_per_s > 1e6 and 0 < pair.latency_s < 0.1
    assert result.allreduce.ranks == 2 and result.allreduce.bus_bandwidth_bytes_per_s > 1e6
    assert fractions and fractions[-1] == 1.0


def test_cli_profile_writes_a_cluster_file_the_planner_reads(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from potluck.cli import app

    out = tmp_path / "cluster.yaml"
    ran = CliRunner().invoke(app, ["profile", "--ranks", "1", "--model", "tiny-llama",
                                   "--budget", "0.02", "--out", str(out), "--json"])
    assert ran.exit_code == 0, ran.output
    summary = json.loads(ran.stdout)
    assert summary["device_type"] == "cpu" and summary["ranks"][0]["matmul_tflops"]["fp32"] > 0
    spec = load_cluster(out)
    assert spec.calibration is not None and spec.calibration.devices[0].device == "cpu"
