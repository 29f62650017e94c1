"""CPU ranks are planned with this machine's measured figures when the cluster has none."""

from __future__ import annotations

import json

import pytest

from potluck.cluster.spec import parse_cluster
from potluck.model.loading import load_model
from potluck.planner.formulas import MEMORY_BANDWIDTH_EFFICIENCY
from potluck.planner.gemm import achievable_flops
from potluck.plans import DType
from potluck.profiler import quick
from potluck.profiler.compute import DeviceMeasurement

CPU2 = parse_cluster("name: cpu2\nnodes:\n  - {name: box, gpu: cpu, gpus_per_node: 2}\n",
                     "cpu2.yaml")
MODEL = load_model("tiny-llama")
MEASURED = DeviceMeasurement("cpu", {"fp32": 40e9}, 6e9)


@pytest.fixture
def measured(monkeypatch) -> list[int]:
    """Every measurement returns MEASURED; the list holds the rank counts measured for."""
    calls: list[int] = []

    def fake(model, ranks, threads):
        calls.append(ranks)
        return MEASURED

    monkeypatch.setattr(quick, "_measure", fake)
    monkeypatch.setattr(quick, "_MEASURED", {})
    return calls


def test_only_cpu_devices_without_a_calibration_entry_are_measured() -> None:
    assert quick.needs_measurement(CPU2)
    calibrated = parse_cluster("nodes:\n  - {name: box, gpu: cpu, gpus_per_node: 2}\n"
                               "calibration:\n  devices:\n    cpu: {matmul_efficiency: 0.3}\n",
                               "c.yaml")
    assert not quick.needs_measurement(calibrated)
    gpus = parse_cluster("nodes:\n  - {name: g, gpu: rtx3090, gpus_per_node: 2}\n", "g.yaml")
    assert not quick.needs_measurement(gpus)
    assert quick.with_measured_cpu(gpus, MODEL) is gpus


def test_the_measured_figures_become_the_cpu_calibration(measured) -> None:
    spec = quick.with_measured_cpu(CPU2, MODEL)
    cpu = spec.device_type("cpu")
    assert achievable_flops(cpu, DType.FP32) == pytest.approx(40e9, rel=1e-9)  # FP32, what CPU ranks use
    assert cpu.memory_bandwidth_bytes_per_s * MEMORY_BANDWIDTH_EFFICIENCY == pytest.approx(6e9)
    assert [d.device for d in spec.calibration.devices] == ["cpu"]
    assert measured == [2]  # one rank's share of a machine of two ranks


def test_measured_once_per_process_and_kept_in_the_run_directory(measured, tmp_path,
                                                                  monkeypatch) -> None:
    quick.with_measured_cpu(CPU2, MODEL, tmp_path)
    quick.with_measured_cpu(CPU2, MODEL, tmp_path)
    assert measured == [2]
    assert not (tmp_path / quick.CACHE_FILE).exists()  # planning writes nothing
    quick.keep_measurement(MODEL, 2, tmp_path)  # what launching a run there does
    monkeypatch.setattr(quick, "_MEASURED", {})  # a new process: the run directory's figures
    spec = quick.with_measured_cpu(CPU2, MODEL, tmp_path)
    assert measured == [2] and achievable_flops(spec.device_type("cpu"), DType.FP32) == pytest.approx(40e9)


@pytest.mark.parametrize("content", [
    b"\x80\x81binary", b"[1, 2]", b'{"key": KEY, "matmul_flops": {"fp32": NaN}, '
    b'"memory_bandwidth_bytes_per_s": 6e9}', b'{"key": KEY, "matmul_flops": {"fp32": -1}, '
    b'"memory_bandwidth_bytes_per_s": 6e9}', b'{"key": KEY, "matmul_flops": 5, '
    b'"memory_bandwidth_bytes_per_s": 6e9}', b'{"key": KEY, "surprise": 1}',
], ids=["binary", "a list", "nan", "negative", "not a mapping", "other keys"])
def test_a_cache_potluck_did_not_write_is_measured_again(measured, tmp_path, content) -> None:
    """A run directory may come from someone else: its cache is only ever a hint."""
    key = json.dumps(repr(quick._key(MODEL, 2))).encode()
    (tmp_path / quick.CACHE_FILE).write_bytes(content.replace(b"KEY", key))
    spec = quick.with_measured_cpu(CPU2, MODEL, tmp_path)
    assert measured == [2]
    assert achievable_flops(spec.device_type("cpu"), DType.FP32) == pytest.approx(40e9)
