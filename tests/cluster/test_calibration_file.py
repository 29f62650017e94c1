"""One writer for the calibration section: what it writes is what the planner reads back,
it replaces a file's own section and keeps the rest of the file as written."""

from __future__ import annotations

import pytest
import yaml

from potluck.cluster.calibration import (
    Calibration,
    DeviceCalibration,
    LinkCalibration,
    MeasuredDevice,
    MeasuredLink,
)
from potluck.cluster.calibration_file import (
    calibration_section,
    with_calibration,
    write_calibrated_cluster,
)
from potluck.cluster.nodes import PathKind
from potluck.cluster.spec import parse_cluster
from potluck.model import load_model
from potluck.planner.search import search
from potluck.plans import TrainingShape

LAB = """# our lab: written by hand
name: lab
nodes:
  - name: box3090
    gpu: rtx3090
    gpus_per_node: 4
    nvlink: pairs   # bridged pairs
  - name: a100
    gpu: a100-80g-sxm
    gpus_per_node: 2
"""

OLD_SECTION = """calibration:
  source: an older profile
  devices:
    rtx3090: {matmul_efficiency: 0.9}
"""

LINKS = """links:
  - between: [box3090, a100]
    bandwidth: 10Gb/s
"""

FOUND = Calibration(
    devices=(
        DeviceCalibration("rtx3090", 0.5123456, 0.75, MeasuredDevice(
            (("fp32", 31.1e12), ("bf16", 61.23456e12)), 701.2345e9)),
        DeviceCalibration("a100-80g-sxm", matmul_efficiency=0.62),
    ),
    links=(
        LinkCalibration(11.2e9, 12.5e-6, PathKind.PCIE, ("box3090",),
                        measured=MeasuredLink(9.87654e9, 6)),
        LinkCalibration(0.94e9 / 8, 18e-3, between=("box3090", "a100")),
    ),
    source="potluck profile 0.1.0 (test)",
)


def test_the_planner_reads_back_what_was_written() -> None:
    read = parse_cluster(with_calibration(LAB, FOUND)).calibration
    assert read is not None and read.source == FOUND.source
    assert [(d.device, d.matmul_efficiency, d.memory_bandwidth_factor) for d in read.devices] == [
        ("rtx3090", 0.51235, 0.75), ("a100-80g-sxm", 0.62, None)]
    pcie, between = read.links
    assert (pcie.kind, pcie.groups, pcie.between) == (PathKind.PCIE, ("box3090",), None)
    assert (pcie.bandwidth_bytes_per_s, pcie.latency_s) == pytest.approx((11.2e9, 12.5e-6))
    assert (between.kind, between.between) == (PathKind.NETWORK, ("box3090", "a100"))
    assert (between.bandwidth_bytes_per_s, between.latency_s) == pytest.approx((0.1175e9, 0.018))


def test_measured_figures_are_written_for_people_and_not_read() -> None:
    section = calibration_section(FOUND)
    assert section["devices"]["rtx3090"]["measured"] == {
        "tflops_fp32": 31.1, "tflops_bf16": 61.235, "memory_bandwidth": "701.23GB/s"}
    assert section["links"][0]["measured"] == {"allreduce_bus_bandwidth": "9.8765GB/s",
                                               "allreduce_ranks": 6}
    read = parse_cluster(with_calibration(LAB, FOUND)).calibration
    assert all(d.measured is None for d in read.devices)
    assert all(link.measured is None for link in read.links)


def test_figures_have_five_significant_digits_in_gb_per_s_and_microseconds() -> None:
    section = calibration_section(FOUND)
    assert list(section) == ["source", "devices", "links"]
    assert section["links"][0] == {
        "kind": "pcie", "groups": ["box3090"], "bandwidth": "11.2GB/s", "latency": "12.5us",
        "measured": {"allreduce_bus_bandwidth": "9.8765GB/s", "allreduce_ranks": 6}}
    assert section["links"][1] == {"between": ["box3090", "a100"], "bandwidth": "0.1175GB/s",
                                   "latency": "18000us"}
    assert "links" not in calibration_section(Calibration(source="nothing to say"))


def test_the_section_is_replaced_and_the_rest_of_the_file_kept() -> None:
    text = with_calibration(LAB + OLD_SECTION + LINKS, FOUND)
    kept, section = text.split("calibration:\n")
    assert kept == LAB + LINKS  # comments, order and the keys after the old section
    assert text.count("calibration:") == 1 and "an older profile" not in text
    assert yaml.safe_load("calibration:\n" + section)["calibration"] == calibration_section(FOUND)
    assert parse_cluster(text).links[0].between == ("box3090", "a100")  # declared, then calibrated


def test_a_file_without_a_section_gets_one_at_the_end() -> None:
    text = with_calibration(LAB, FOUND)
    assert text.startswith(LAB) and text[len(LAB):].startswith("calibration:\n")
    assert with_calibration(text, FOUND) == text  # writing again changes nothing


@pytest.mark.parametrize("found", [
    FOUND,  # as potluck profile writes it: measured figures, links inside a group
    Calibration((DeviceCalibration("rtx3090", 0.3, 1.1),),  # as potluck calibrate writes it
                (LinkCalibration(2e9, None, PathKind.NETWORK, ("box3090",)),),
                "potluck calibrate 0.1.0 (test)"),
])
def test_a_written_file_is_one_the_planner_plans_on(tmp_path, found: Calibration) -> None:
    path = tmp_path / "lab-calibrated.yaml"
    spec = write_calibrated_cluster(path, LAB, found)
    assert spec == parse_cluster(path.read_text(), str(path))
    assert spec.device_type("rtx3090").matmul_efficiency == pytest.approx(
        found.devices[0].matmul_efficiency, rel=1e-4)  # five significant digits
    result = search(spec, load_model("tiny-llama"), TrainingShape(8, 128))
    assert result.best.cluster == spec
