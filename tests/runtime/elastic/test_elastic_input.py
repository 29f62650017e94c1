"""Bad input to ``potluck train --elastic``/``--inject-failure`` and ``potluck join``: one
line that says what is wrong, a non-zero exit, nothing started or written (the CLI run
in this process: every case fails before a rank starts)."""

import sys

import pytest

from potluck.cli import main
from potluck.cluster.spec import parse_cluster
from potluck.model.loading import load_model
from potluck.planner.search import search
from potluck.plans import TrainingShape, save_plan

CLUSTER = parse_cluster("nodes: [{name: cpu, gpu: cpu, gpus_per_node: 2}]\n")


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    save_plan(search(CLUSTER, load_model("tiny-llama"), TrainingShape(4, 32)).best, path)
    return path


def _cli(monkeypatch, capsys, *args):
    """``potluck ARGS`` here: its exit code and the lines it wrote to stderr."""
    monkeypatch.setattr(sys, "argv", ["potluck", *map(str, args)])
    with pytest.raises(SystemExit) as stop:
        main()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return stop.value.code, lines


def _one_line(monkeypatch, capsys, *args) -> str:
    code, lines = _cli(monkeypatch, capsys, *args)
    assert code != 0 and len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(("extra", "fragment"), [
    (["--elastic", "--inject-failure", "one@two"], "--inject-failure takes RANK@STEP, such as 1@5"),
    (["--elastic", "--inject-failure", "2@3"], "--inject-failure 2@3: the plan has ranks 0-1"),
    (["--elastic", "--inject-failure", "1@9"], "the step must be 1-7"),
    (["--inject-failure", "1@2"], "--inject-failure is a drill of an elastic run (a rank killed "
                                  "for it to recover from); add --elastic"),
    (["--elastic", "--replan-margin", "1.5"], "--replan-margin is a fraction"),
    (["--elastic", "--max-restarts", "-1"], "--max-restarts must be 0 or more"),
])
def test_bad_elastic_flags_are_one_line(monkeypatch, capsys, tmp_path, plan_file, extra,
                                        fragment):
    out = tmp_path / "run"
    line = _one_line(monkeypatch, capsys, "train", "--plan", plan_file, "--steps", "8",
                     "--out", out, *extra)
    assert fragment in line
    assert not out.exists()


def test_elastic_without_a_run_directory_is_one_line(monkeypatch, capsys, plan_file):
    line = _one_line(monkeypatch, capsys, "train", "--plan", plan_file, "--elastic")
    assert "--elastic restarts from the run's checkpoints: give --out DIR" in line


def test_joining_names_devices_of_the_runs_cluster(monkeypatch, capsys, tmp_path, plan_file):
    line = _one_line(monkeypatch, capsys, "join", tmp_path, "-d", "cpu.0:1")
    assert "is not a run directory" in line
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text(plan_file.read_text())
    line = _one_line(monkeypatch, capsys, "join", run, "-d", "gpu.0:0")
    assert "device 'gpu.0:0' is not in the run's cluster" in line
    assert _cli(monkeypatch, capsys, "join", run, "-d", "cpu.0:1")[0] == 0
    assert [p.name for p in (run / "joined").iterdir()] == ["cpu.0:1"]


def test_joining_a_read_only_run_is_one_line(monkeypatch, capsys, plan_file, read_only_folder):
    run = read_only_folder
    run.chmod(0o700)
    (run / "plan.json").write_text(plan_file.read_text())
    run.chmod(0o500)
    line = _one_line(monkeypatch, capsys, "join", run, "-d", "cpu.0:1")
    assert line == (f"potluck: error: cannot create the folder {run / 'joined'}: permission "
                    "denied: write elsewhere or change the folder's permissions (Permission "
                    "denied)")
