"""Bad input to ``potluck train --elastic``/``--inject-failure`` and ``potluck join``: one
line that says what is wrong, a non-zero exit, nothing started or written."""

import pytest
from runtime_helpers import potluck

CLUSTER = "nodes: [{name: cpu, gpu: cpu, gpus_per_node: 2}]\n"


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan")
    (folder / "cpus.yaml").write_text(CLUSTER)
    plan = folder / "plan.json"
    made = potluck("plan", "-c", str(folder / "cpus.yaml"), "-m", "tiny-llama",
                   "--global-batch", "4", "--seq-len", "32", "-o", str(plan))
    assert made.returncode == 0, made.stderr
    return plan


def _one_line(result) -> str:
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize(("extra", "fragment"), [
    (["--inject-failure", "one@two"], "--inject-failure takes RANK@STEP, such as 1@5"),
    (["--inject-failure", "2@3"], "--inject-failure 2@3: the plan has ranks 0-1"),
    (["--inject-failure", "1@9"], "the step must be 1-7"),
    (["--elastic", "--replan-margin", "1.5"], "--replan-margin is a fraction"),
    (["--elastic", "--max-restarts", "-1"], "--max-restarts must be 0 or more"),
])
def test_bad_elastic_flags_are_one_line(tmp_path, plan_file, extra, fragment):
    out = tmp_path / "run"
    result = potluck("train", "--plan", str(plan_file), "--steps", "8", "--out", str(out),
                     *extra)
    assert fragment in _one_line(result)
    assert not out.exists()


def test_elastic_without_a_run_directory_is_one_line(plan_file):
    line = _one_line(potluck("train", "--plan", str(plan_file), "--elastic"))
    assert "--elastic restarts from the run's checkpoints: give --out DIR" in line


def test_joining_names_devices_of_the_runs_cluster(tmp_path, plan_file):
    assert "is not a run directory" in _one_line(potluck("join", str(tmp_path), "-d", "cpu.0:1"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text(plan_file.read_text())
    line = _one_line(potluck("join", str(run), "-d", "gpu.0:0"))
    assert "device 'gpu.0:0' is not in the run's cluster" in line
    joined = potluck("join", str(run), "-d", "cpu.0:1")
    assert joined.returncode == 0, joined.stderr
    assert [p.name for p in (run / "joined").iterdir()] == ["cpu.0:1"]
