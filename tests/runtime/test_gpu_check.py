"""benchmarks/gpu_check.py's parts that run without a GPU: naming the GPU, the loss check,
finding the GPU tests, and the one line it exits with where there is no CUDA."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
KNOWN = ["a10", "a100-40g-pcie", "a100-80g-pcie", "a100-80g-sxm", "gh200", "h100-pcie",
         "h100-sxm", "h200", "l40", "l40s", "rtx-6000-ada", "rtx-a6000", "rtx3090", "rtx4090",
         "t4", "v100-16g", "v100-32g"]
GB = 2**30


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("name", "memory_gb", "catalog"), [
    ("NVIDIA A100-SXM4-80GB", 80, "a100-80g-sxm"),
    ("NVIDIA A100-PCIE-40GB", 40, "a100-40g-pcie"),
    ("NVIDIA A100 80GB PCIe", 80, "a100-80g-pcie"),
    ("NVIDIA H100 80GB HBM3", 80, "h100-sxm"),
    ("NVIDIA H100 PCIe", 80, "h100-pcie"),
    ("NVIDIA H200", 141, "h200"),
    ("NVIDIA GH200 480GB", 96, "gh200"),
    ("Tesla V100-SXM2-16GB", 16, "v100-16g"),
    ("Tesla V100-PCIE-32GB", 32, "v100-32g"),
    ("Tesla T4", 15, "t4"),
    ("NVIDIA GeForce RTX 4090", 24, "rtx4090"),
    ("NVIDIA RTX A6000", 48, "rtx-a6000"),
    ("NVIDIA RTX 6000 Ada Generation", 48, "rtx-6000-ada"),
    ("NVIDIA L40S", 48, "l40s"),
])
def test_the_gpu_torch_names_maps_to_its_catalog_entry(gpu_check, name, memory_gb, catalog):
    assert gpu_check.catalog_name(name, memory_gb * GB, KNOWN) == catalog


def test_an_unknown_gpu_asks_for_its_name(gpu_check):
    with pytest.raises(gpu_check.NoGpu, match="pass --device NAME"):
        gpu_check.catalog_name("Matrox G200", 8 * GB, KNOWN)


def test_the_loss_must_be_finite_and_fall(gpu_check):
    assert gpu_check.loss_falls([5.0, 4.8, 4.9, 4.0, 3.5, 3.6])[0]
    assert not gpu_check.loss_falls([5.0, 5.0, 5.0, 5.1, 5.2, 5.0])[0]
    assert not gpu_check.loss_falls([5.0, float("nan"), 4.0, 3.0])[0]
    assert not gpu_check.loss_falls([])[0]


def test_the_gpu_tests_are_found_by_their_marker(gpu_check):
    names = {p.name for p in gpu_check.gpu_test_files()}
    assert "test_gpu.py" in names and "test_gpu_check.py" not in names


def test_without_cuda_it_exits_2_with_one_line(gpu_check, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "no CUDA GPU" in err


def test_a_wrong_device_name_exits_2_with_one_line(gpu_check, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    assert gpu_check.main(["--device", "a1000"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "unknown GPU type 'a1000'" in err
