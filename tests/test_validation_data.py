"""The published validation data: every CSV parses with the required header and positive
values, and every set of benchmarks/validation.py has its files and its source listed."""

from __future__ import annotations

import csv
import functools
import importlib.util
import sys
from pathlib import Path

import pytest

from potluck.calibrate.measured.runs import OPTIONAL, REQUIRED

DATA = Path(__file__).parent.parent / "benchmarks" / "data"


@functools.cache
def _validation():
    spec = importlib.util.spec_from_file_location("validation", DATA.parent / "validation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["validation"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _rows(path: Path) -> tuple[list[str], list[list[str]]]:
    lines = [line for line in path.read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    header, *rows = list(csv.reader(lines))
    return [cell.strip() for cell in header], rows


@pytest.mark.parametrize("path", sorted(DATA.glob("*.csv")), ids=lambda p: p.name)
def test_csv_has_required_header_and_positive_values(path: Path) -> None:
    header, rows = _rows(path)
    assert set(REQUIRED) <= set(header), f"{path.name}: header {header}"
    assert set(header) <= set(REQUIRED + OPTIONAL), f"{path.name}: unknown column in {header}"
    assert rows, f"{path.name}: no runs"
    for row in rows:
        cells = dict(zip(header, row, strict=True))
        for name in REQUIRED:
            assert float(cells[name]) > 0, f"{path.name}: {name} = {cells[name]}"
        per_step = int(cells["dp"]) * int(cells["micro_batch_size"])
        assert int(cells["global_batch"]) % per_step == 0, f"{path.name}: {row}"


def test_every_set_has_its_files_and_source_listed() -> None:
    readme = (DATA / "README.md").read_text()
    validation = _validation()
    assert validation.SETS
    for vset in validation.SETS:
        for name in (vset.runs, vset.cluster):
            assert (DATA / name).is_file(), name
            assert f"`{name}`" in readme.split(f"`{vset.name}`", 1)[1].splitlines()[0]
        assert f"| `{vset.name}` |" in readme, f"{vset.name} has no source row in README.md"
        assert vset.framework in validation.FRAMEWORKS
        validation.execution(vset.framework)  # its preset is known
        assert vset.source


def test_every_run_fits_its_sets_cluster() -> None:
    from potluck.api import as_cluster

    validation = _validation()
    for vset in validation.SETS:
        gpus = as_cluster(DATA / vset.cluster).num_gpus
        runs = validation.read_set_runs(vset)
        assert runs, vset.name
        for run in runs:
            assert run.tp * run.pp * run.dp <= gpus, f"{vset.name} line {run.line}"


def test_every_csv_belongs_to_a_set() -> None:
    named = {vset.runs for vset in _validation().SETS}
    assert {p.name for p in DATA.glob("*.csv")} == named


def test_spearman_of_hand_ranked_values() -> None:
    from potluck.calibrate.measured.stats import ranks, spearman

    assert ranks([3.0, 1.0, 2.0, 2.0]) == [4.0, 1.0, 2.5, 2.5]
    assert spearman([1.0, 2.0, 3.0], [10.0, 20.0, 30.0]) == pytest.approx(1.0)
    assert spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    # ranks (1,2,3,4) against (2,1,4,3): 1 - 6*4/(4*15) = 0.6
    assert spearman([1.0, 2.0, 3.0, 4.0], [2.0, 1.0, 4.0, 3.0]) == pytest.approx(0.6)


def test_every_fsdp_run_that_ran_fits():
    """The ZeRO-3 layouts llm-foundry ran (its throughput tables: every run is one that fit)
    fit under the fsdp traits: none is refused, and each block's model is the one named."""
    validation = _validation()
    for vset in validation.SETS:
        if vset.framework != "llm-foundry":
            continue
        runs = validation.read_set_runs(vset)
        assert {run.zero_stage for run in runs} == {3}  # FULL_SHARD, said by the CSV
        assert set(validation.model_lines(vset.runs)) == {run.line for run in runs}
        for run in runs:
            outcome = validation.predict_run(vset, run)
            assert outcome.predicted_s is not None, f"{vset.name} line {run.line}: {outcome.refusal}"


def _calibrated_on_four(name: str):
    validation = _validation()
    vset = next(s for s in validation.SETS if s.name == name)
    outcomes = [validation.predict_run(vset, run) for run in validation.read_set_runs(vset)]
    result = validation.calibrated(vset, outcomes, 4)
    assert len(result.after) == len(outcomes) - 4
    return result


def _mape(outcomes: list) -> float:
    from potluck.calibrate.measured.stats import mape

    done = [o for o in outcomes if o.predicted_s is not None]  # not the refused layouts
    assert done
    return mape([o.predicted_s for o in done], [o.run.iteration_time_s for o in done])


def test_calibrating_on_four_runs_predicts_the_rest_no_worse() -> None:
    """``validation.py --calibrate-on 4`` on BigScience's 1B3 runs on V100 16GB (one of the
    quickest sets): the fit on 4 runs, its inputs chosen by held-out error, predicts the
    set's other runs (never seen by the fit) better than the cluster file alone does."""
    result = _calibrated_on_four("bigscience-v100-16g")
    assert not result.refusal and result.fitted
    assert _mape(result.after) < _mape(result.before)


def test_a_fit_four_runs_cannot_justify_is_refused_and_the_rest_keep_their_figures() -> None:
    """Sailor's GH200 runs: on its 4 runs the best fit is better held out than the cluster
    file, but not significantly (the runs disagree), so it is refused; the other runs keep
    the uncalibrated predictions, no worse by construction."""
    result = _calibrated_on_four("sailor-gh200")
    assert result.refusal.startswith("no fit predicts runs left out of it significantly better")
    assert _mape(result.after) == _mape(result.before)
