"""potluck calibrate --measured: the fit recovers known inputs from synthetic runs,
the leave-one-out error, the refusal, and the written file the planner then uses."""

from __future__ import annotations

import math

import pytest
from measuredkit import (
    CLAIMED_TEXT,
    LAYOUTS,
    MODEL,
    TRUE_EFFICIENCY,
    TRUE_MICRO_BATCH_OVERHEAD_S,
    TRUE_NETWORK_FACTOR,
    true_times,
    write_claimed,
    write_runs,
)

from potluck.calibrate.measured.calibrate import (
    CalibrationRefused,
    calibrate_measured,
    check_improves,
)
from potluck.calibrate.measured.fit import Fit
from potluck.calibrate.measured.params import Kind, Parameter
from potluck.calibrate.measured.stats import cross_validated, mape, ranks, spearman
from potluck.cluster.spec import load_cluster, parse_cluster
from potluck.errors import ConfigError
from potluck.planner.options import SearchOptions
from potluck.planner.search import search
from potluck.plans import Execution, TrainingShape


def fitted(outcome) -> dict[str, float]:
    return {p.name: v for p, v in outcome.fit.values.items()}


def test_the_fit_recovers_efficiency_network_and_overhead(tmp_path) -> None:
    runs = write_runs(tmp_path / "runs.csv", true_times())
    outcome = calibrate_measured(runs, MODEL, write_claimed(tmp_path / "lab.yaml"),
                                 tmp_path / "calibrated.yaml")
    values = fitted(outcome)
    assert values["a100-80g-sxm matmul_efficiency"] == pytest.approx(TRUE_EFFICIENCY, rel=0.02)
    assert values["network bandwidth factor"] == pytest.approx(TRUE_NETWORK_FACTOR, rel=0.02)
    assert values["micro_batch_overhead_s"] == pytest.approx(TRUE_MICRO_BATCH_OVERHEAD_S, rel=0.02)
    assert len(values) <= len(LAYOUTS) // 2
    assert mape(outcome.after_s, outcome.measured_s) < 0.005 < mape(outcome.before_s, outcome.measured_s)


def test_progress_names_each_set_of_inputs_scored(tmp_path) -> None:
    runs = write_runs(tmp_path / "runs.csv", true_times())
    heard: list[tuple[float, str]] = []
    outcome = calibrate_measured(runs, MODEL, write_claimed(tmp_path / "lab.yaml"),
                                 tmp_path / "calibrated.yaml", lambda f, what: heard.append((f, what)))
    fractions = [f for f, _ in heard]
    assert heard[0] == (0.0, f"planning {len(LAYOUTS)} runs")
    assert fractions == sorted(fractions) and fractions[-1] == pytest.approx(1.0)
    scored = [what for _, what in heard if what.startswith("set ")]
    assert len(scored) == len(outcome.selection.tried) - 1  # every set but the empty one
    assert scored[0].startswith("set 1 of at most ")


def test_the_written_file_carries_the_fit(tmp_path) -> None:
    runs = write_runs(tmp_path / "runs.csv", true_times())
    out = tmp_path / "calibrated.yaml"
    calibrate_measured(runs, MODEL, write_claimed(tmp_path / "lab.yaml"), out)
    text = out.read_text()
    assert text.startswith(CLAIMED_TEXT)  # the input's text is kept, comments included
    spec = parse_cluster(text, str(out))
    assert spec.device_type("a100-80g-sxm").matmul_efficiency == pytest.approx(TRUE_EFFICIENCY, rel=0.02)
    assert spec.nodes[0].inter_bandwidth_bytes_per_s == pytest.approx(0.4 * 10e9 / 8, rel=0.02)
    overhead = spec.execution.micro_batch_overhead_s
    assert overhead == pytest.approx(TRUE_MICRO_BATCH_OVERHEAD_S, rel=0.02)
    # a layout the fit never saw, predicted on the written file, matches the true cluster
    shape = TrainingShape(64, 512, execution=Execution(micro_batch_overhead_s=overhead))
    options = SearchOptions(tp=2, pp=2, dp=1, micro_batch_size=4, top_k=1)
    unseen = search(spec, MODEL, shape, options).best.prediction.iteration_time_s
    (truth,) = true_times([(2, 2, 1, 4, 64, 512)])
    assert unseen == pytest.approx(truth, rel=0.02)


def test_the_planner_uses_a_fitted_efficiency_and_network(tmp_path) -> None:
    runs = write_runs(tmp_path / "runs.csv", true_times(overhead_s=0.0))
    out = tmp_path / "calibrated.yaml"
    outcome = calibrate_measured(runs, MODEL, write_claimed(tmp_path / "lab.yaml"), out)
    assert {p.kind for p in outcome.fit.values} == {Kind.EFFICIENCY, Kind.LINK}
    assert "execution" not in out.read_text()  # no overhead fitted: a file potluck plan reads
    spec = load_cluster(out)
    layout = LAYOUTS[0]
    best = search(spec, MODEL, TrainingShape(layout[4], layout[5]),
                  SearchOptions(tp=1, pp=1, dp=4, micro_batch_size=2, top_k=1)).best
    assert best.prediction.iteration_time_s == pytest.approx(outcome.measured_s[0], rel=0.01)


def test_a_run_the_planner_refuses_is_left_out_not_fatal(tmp_path) -> None:
    layouts = (*LAYOUTS, (1, 1, 1, 1, 8, 4096))  # GPT-3 models read at most 2048 tokens
    times = [*true_times(), 1.0]
    outcome = calibrate_measured(write_runs(tmp_path / "runs.csv", times, layouts), MODEL,
                                 write_claimed(tmp_path / "lab.yaml"), tmp_path / "out.yaml")
    (skipped,) = outcome.skipped
    assert skipped.run.line == len(layouts) + 1 and skipped.reason
    assert len(outcome.planned) == len(LAYOUTS)


def test_leave_one_out_and_folds_by_hand() -> None:
    measured = [1.0, 2.0, 3.0]

    def mean_of(rows: list[int], left: list[int]) -> list[float]:  # a "fit": the mean it saw
        return [sum(measured[k] for k in rows) / len(rows)] * len(left)

    loo = cross_validated(3, 3, mean_of)
    assert loo == [2.5, 2.0, 1.5]
    assert cross_validated(4, 2, lambda rows, left: [float(sum(rows))] * len(left)) == [
        4.0, 2.0, 4.0, 2.0]  # rows 0 and 2 left out together, fitted to 1 + 3
    assert mape(loo, measured) == pytest.approx((1.5 + 0.0 + 0.5) / 3)
    assert spearman(loo, measured) == pytest.approx(-1.0)


def test_spearman_ranks_ties_by_their_mean() -> None:
    assert ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]
    # ranks (1, 2.5, 2.5) against (1, 2, 3): covariance 1.5 over sqrt(1.5 * 2)
    assert spearman([1.0, 2.0, 2.0], [1.0, 2.0, 3.0]) == pytest.approx(1.5 / math.sqrt(3.0))
    assert spearman([1.0], [1.0]) is None


def test_leave_one_out_of_an_exact_single_overhead_is_exact(tmp_path) -> None:
    """Runs that differ from the claim only by a per-iteration overhead: every fit without
    a run finds that overhead, so the run left out is predicted exactly."""
    times = [t + 0.05 for t in true_times(overhead_s=0.0, cluster_text=CLAIMED_TEXT)]
    outcome = calibrate_measured(write_runs(tmp_path / "runs.csv", times), MODEL,
                                 write_claimed(tmp_path / "lab.yaml"), tmp_path / "out.yaml")
    assert fitted(outcome) == {"step_overhead_s": pytest.approx(0.05, rel=1e-4)}
    assert outcome.held_out_s == pytest.approx(outcome.measured_s, rel=1e-4)


def test_runs_the_claim_already_predicts_are_refused(tmp_path) -> None:
    times = true_times(overhead_s=0.0, cluster_text=CLAIMED_TEXT)
    out = tmp_path / "out.yaml"
    with pytest.raises(CalibrationRefused, match="no fit predicts runs left out of it "
                                                 "significantly better than the cluster file"):
        calibrate_measured(write_runs(tmp_path / "runs.csv", times), MODEL,
                           write_claimed(tmp_path / "lab.yaml"), out)
    assert not out.exists()


def test_a_fit_worse_than_the_claim_is_refused() -> None:
    param = Parameter(Kind.STEP_OVERHEAD, "", 0.0, 0.0, 1.0)
    measured = [1.0, 2.0]
    with pytest.raises(CalibrationRefused, match=r"error 5.0% before, 10.0% after"):
        check_improves(Fit({param: 0.1}), (1.05, 2.1), (1.1, 2.2), measured)
    check_improves(Fit({param: 0.1}), (1.1, 2.2), (1.05, 2.1), measured)  # better: accepted


def test_one_plannable_run_is_not_enough(tmp_path) -> None:
    runs = write_runs(tmp_path / "runs.csv", true_times(LAYOUTS[:1]), LAYOUTS[:1])
    with pytest.raises(ConfigError, match=r"runs.csv: 1 of 1 runs could be planned, a fit needs at "
                                          r"least 2; add runs"):
        calibrate_measured(runs, MODEL, write_claimed(tmp_path / "lab.yaml"), tmp_path / "out.yaml")


def test_a_missing_cluster_file_is_one_line(tmp_path) -> None:
    runs = write_runs(tmp_path / "runs.csv", [1.0, 2.0], LAYOUTS[:2])
    with pytest.raises(ConfigError, match="cluster file .*nope.yaml' not found; check the path"):
        calibrate_measured(runs, MODEL, tmp_path / "nope.yaml")


def test_runs_are_planned_with_the_cluster_files_execution_preset(tmp_path) -> None:
    runs = write_runs(tmp_path / "runs.csv", true_times())
    cluster = tmp_path / "lab.yaml"
    cluster.write_text(CLAIMED_TEXT + "execution: {preset: megatron-lm-2021}\n")
    outcome = calibrate_measured(runs, MODEL, cluster, tmp_path / "out.yaml")
    traits = {p.plan.training.execution.fused_kernels for p in outcome.planned}
    assert traits == {True}  # the preset's, not potluck's
    assert load_cluster(tmp_path / "out.yaml").execution.fused_kernels  # and potluck plan reads it
