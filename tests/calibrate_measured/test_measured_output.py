"""The calibrated file of a measured-runs fit: the input's own calibration and execution
sections merged with the fit."""

from __future__ import annotations

import pytest
import yaml
from measuredkit import CLAIMED_TEXT

from potluck.calibrate.measured.output import calibrated_text, merged_calibration
from potluck.calibrate.measured.params import Kind, Parameter
from potluck.cluster.calibration_file import with_execution
from potluck.cluster.catalog import lookup
from potluck.cluster.spec import parse_cluster
from potluck.errors import ConfigError
from potluck.yamlio import parse_yaml

INPUT = CLAIMED_TEXT + """calibration:
  source: potluck profile
  devices:
    a100-80g-sxm: {matmul_efficiency: 0.7, memory_bandwidth_factor: 0.9}
execution:
  preset: megatron-lm
  step_overhead_s: 0.01
"""


def test_the_fit_replaces_only_what_it_fitted() -> None:
    spec = parse_cluster(INPUT, "lab.yaml")
    values = {Parameter(Kind.EFFICIENCY, "a100-80g-sxm", 0.7, 0.05, 1.0): 0.5,
              Parameter(Kind.LINK, "network", 1.0, 0.01, 1.0): 0.5,
              Parameter(Kind.MICRO_BATCH_OVERHEAD, "", 0.0, 0.0, 1.0): 0.002,
              Parameter(Kind.BLOCK_HOST, "", 192e-6, 1e-6, 0.1): 0.004}
    text = calibrated_text(INPUT, merged_calibration(spec, values, "fit"), values, "lab.yaml")
    assert text.count("calibration:") == 1 and text.count("execution:") == 1
    after = parse_cluster(text, "out.yaml")
    after_section = parse_yaml(text, "out.yaml")["execution"]
    a100 = after.device_type("a100-80g-sxm")
    assert a100.matmul_efficiency == 0.5
    catalog_bandwidth = lookup("a100-80g-sxm").memory_bandwidth_bytes_per_s
    assert a100.memory_bandwidth_bytes_per_s == pytest.approx(0.9 * catalog_bandwidth)  # kept
    assert after.nodes[0].inter_bandwidth_bytes_per_s == pytest.approx(0.5 * 10e9 / 8)
    assert after_section == {"preset": "megatron-lm", "step_overhead_s": 0.01,
                             "micro_batch_overhead_s": 0.002, "block_host_s": 0.004}


def test_fitted_host_times_replace_their_keys_in_the_one_execution_section() -> None:
    text = "name: lab\nexecution:\n  preset: megatron\n  step_overhead_s: 0.01\nnodes: []\n"
    written = with_execution(text, {"step_overhead_s": 0.0123456789, "block_host_s": 0.004})
    assert written.count("execution:") == 1
    assert written.startswith("name: lab\nnodes: []\n")  # the rest kept as written
    assert yaml.safe_load(written)["execution"] == {"preset": "megatron", "step_overhead_s": 0.012346,
                                                    "block_host_s": 0.004}
    assert with_execution(text, {}) == text  # nothing fitted: the file as it was


def test_an_execution_section_that_is_not_a_mapping_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"lab.yaml: execution must be a mapping of Execution "
                                          r"fields, .* not 'megatron'"):
        with_execution("name: lab\nexecution: megatron\n", {"step_overhead_s": 0.01}, "lab.yaml")
