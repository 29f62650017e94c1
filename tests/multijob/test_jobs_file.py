"""Jobs files as `potluck schedule` reads them: values, defaults, and one line per problem."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from potluck.cluster import parse_cluster
from potluck.multijob import JobsFileError, ThroughputTable, load_jobs

SRC = Path(__file__).resolve().parents[2] / "src"
CLUSTER = """
name: tiny-lab
nodes:
  - {name: fast, gpu: a100-80g-sxm, gpus_per_node: 2, count: 1}
  - {name: slow, gpu: rtx3090, gpus_per_node: 2, count: 2}
"""


@pytest.fixture
def cluster_file(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text(CLUSTER)
    return path


def _load(tmp_path, text):
    path = tmp_path / "jobs.yaml"
    path.write_text(text)
    spec = parse_cluster(CLUSTER)
    table = ThroughputTable(spec)
    return load_jobs(path, spec, lambda job: table.refusal(job.shape))


def test_a_jobs_file_reads_counts_defaults_and_hosts(tmp_path):
    read = _load(tmp_path, """
jobs:
  - {name: a, model: gpt3-125m, global_batch: 8, seq_len: 512, tokens: 2B}
  - {name: b, model: tiny-llama, global_batch: 4, seq_len: 256, tokens: 300M, arrival_h: 1.5,
     priority: 2, deadline_h: 10}
hosts:
  slow: [node-s1, node-s2]
""")
    a, b = read.jobs
    assert (a.tokens, a.arrival_h, a.priority, a.deadline_h) == (2_000_000_000, 0.0, 1.0, None)
    assert (b.tokens, b.arrival_h, b.priority, b.deadline_h) == (300_000_000, 1.5, 2.0, 10.0)
    assert a.shape.training.global_batch == 8 and a.shape.training.seq_len == 512
    assert a.shape.model.name == "gpt3-125m"
    assert read.hosts == {"slow": ("node-s1", "node-s2")}


@pytest.mark.parametrize("host", ["h1\\ntouch owned #", "a;reboot", "a b", "../..", "-x", "$(id)",
                                  "a..b", "'q'"])
def test_a_host_name_that_would_reach_a_shell_unquoted_is_refused(tmp_path, host):
    """Host names reach #SBATCH --nodelist and the launch script's case; each part is a
    name a cluster file allows, parts joined by dots."""
    with pytest.raises(JobsFileError) as caught:
        _load(tmp_path, f"""
jobs:
  - {{name: a, model: tiny-llama, global_batch: 4, seq_len: 256, tokens: 1M}}
hosts:
  slow: ["{host}", node-s2.lab.example]
""")
    (problem,) = caught.value.problems
    assert "hosts.slow.0: host name" in problem and "joined by '.'" in problem


def test_every_problem_is_gathered_one_line_each(tmp_path):
    with pytest.raises(JobsFileError) as caught:
        _load(tmp_path, """
jobs:
  - {name: ok, model: gpt3-125m, global_batch: 8, seq_len: 512, tokens: 1B}
  - {name: ok, model: gpt3-125m, global_batch: 8, seq_len: 512, tokens: 1B}
  - {name: typo, model: gpt3-125m, global_batch: 8, seq_len: 512, tokens: 1B, prority: 2}
""")
    problems = caught.value.problems
    assert len(problems) == 2
    assert "jobs[1] (ok)" in problems[0] and "second job named 'ok'" in problems[0]
    assert ":4:" in problems[0]  # the duplicate's line
    assert "prority" in problems[1] and "did you mean 'priority'" in problems[1]


def potluck(*args):
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "160"}
    return subprocess.run([sys.executable, "-m", "potluck", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def test_the_cli_prints_one_line_per_problem_and_no_traceback(tmp_path, cluster_file):
    jobs = tmp_path / "bad.yaml"
    jobs.write_text("""
jobs:
  - {name: alice, model: llama-9000, global_batch: 8, seq_len: 512, tokens: 1B}
  - {name: bob, model: gpt3-125m, global_batch: 8, seq_len: 512, tokens: lots}
  - {name: bob, model: gpt3-125m, global_batch: 8, seq_len: 512, tokens: 1B}
  - {name: huge, model: gpt3-175b, global_batch: 8, seq_len: 2048, tokens: 1B}
  - {name: eve, model: gpt3-125m, global_batch: 8, seq_len: 512, tokens: 1B, colour: red}
  - {name: nobatch, model: gpt3-125m, seq_len: 512, tokens: 1B}
""")
    ran = potluck("schedule", "--cluster", str(cluster_file), "--jobs", str(jobs))
    assert ran.returncode != 0
    assert "Traceback" not in ran.stderr and ran.stdout == ""
    progress = ("planning ", "planned ")  # the fits are planned, with progress lines
    lines = [line for line in ran.stderr.strip().splitlines() if not line.startswith(progress)]
    assert all(line.startswith("potluck: error: ") for line in lines)
    expected = [("alice", "llama-9000"), ("bob", "tokens"), ("bob", "second job named 'bob'"),
                ("huge", "fits nowhere"), ("eve", "colour"), ("nobatch", "global_batch")]
    assert len(lines) == len(expected)
    for name, words in expected:
        assert any(name in line and words in line for line in lines), (name, words, lines)
