"""``potluck schedule --run`` as specifications: two jobs trained as real elastic runs on a
CPU cluster of two machines, never sharing a device, the long job offered the short one's
machine when it ends; and the command's bad input, one line each."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from potluck import api
from potluck.cli import main
from potluck.cluster import parse_cluster
from potluck.multijob import Job, JobShape, executor
from potluck.multijob.allocations import Allocation
from potluck.multijob.executor import _keep_running, job_steps
from potluck.runtime.elastic.replans import read_replans

CLUSTER = "name: cpu-lab\nnodes: [{name: cpu, gpu: cpu, gpus_per_node: 2, count: 2}]\n"
JOBS = """
jobs:
  - {name: short, model: tiny-llama, global_batch: 8, seq_len: 32, tokens: 100K}
  - {name: long, model: tiny-llama, global_batch: 8, seq_len: 32, tokens: 1M}
"""
STEPS = 60  # the long job's; the short one trains a tenth of its tokens: 6 steps


@pytest.fixture
def files(tmp_path):
    cluster, jobs = tmp_path / "cpu.yaml", tmp_path / "jobs.yaml"
    cluster.write_text(CLUSTER)
    jobs.write_text(JOBS)
    return cluster, jobs


def _steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _holders(events):
    """Replays schedule.jsonl; fails if a device is ever held by two jobs at once."""
    holder = {}
    for event in events:
        for device in event["devices"]:
            if event["action"] in ("start", "join"):
                assert holder.get(device) in (None, event["job"]), (device, event)
                holder[device] = event["job"]
            elif holder.get(device) == event["job"]:
                del holder[device]
    return holder


def test_two_jobs_run_side_by_side_and_the_long_one_takes_the_freed_machine(files, tmp_path):
    cluster, jobs = files
    out, said = tmp_path / "run", []
    outcome = api.schedule_run(cluster, jobs, out=out, policy="fair", steps=STEPS,
                               checkpoint_every=4, dilation=40.0, job_timeout_s=90.0,
                               progress=said.append)

    assert outcome.failed == {} and sorted(outcome.finished) == ["long", "short"]
    assert "launching 2 jobs" in said[0] and "short 6 steps, long 60 steps" in said[0]
    assert _steps(out / "short") == list(range(6))  # every step once
    assert _steps(out / "long") == list(range(STEPS))

    events = [json.loads(line) for line in (out / "schedule.jsonl").read_text().splitlines()]
    assert len(said) == 1 + len(events)  # a progress line per event
    assert _holders(events) == {}  # never shared; all given back at the end
    starts = {e["job"]: e for e in events if e["action"] == "start"}
    assert not set(starts["short"]["devices"]) & set(starts["long"]["devices"])
    finish = next(e for e in events if e["job"] == "short" and e["action"] == "finish")
    join = next(e for e in events if e["job"] == "long" and e["action"] == "join")
    assert join["time_s"] >= finish["time_s"] and join["devices"] == finish["devices"]

    (replan,) = read_replans(out / "long")  # the planner finds the two machines faster
    assert replan["reason"] == "joined" and replan["joined_devices"] == join["devices"]
    assert set(replan["new_devices"]) == set(join["devices"]) | set(starts["long"]["devices"])


# Stand-ins for the jobs' runs, so the executor's own bookkeeping is tested in a second.
SCRIPTS = {
    "short": "import sys; sys.exit('potluck: error: the plan does not fit (a test)')",
    "long": "import time; time.sleep(60)",
}


def _stand_ins(monkeypatch, scripts):
    monkeypatch.setattr(executor._Executor, "_command",
                        lambda self, job, run_dir: [sys.executable, "-c", scripts[job.name]])


def test_a_failed_run_is_one_line_and_a_run_past_its_timeout_is_stopped(files, tmp_path,
                                                                         monkeypatch):
    cluster, jobs = files
    _stand_ins(monkeypatch, SCRIPTS)
    outcome = api.schedule_run(cluster, jobs, out=tmp_path / "run", policy="fair",
                               job_timeout_s=2.0)
    assert outcome.finished == ()
    assert outcome.failed["short"].startswith("exited with 1: the plan does not fit (a test)")
    assert outcome.failed["long"] == "stopped after 2 s (--job-timeout)"
    events = [json.loads(line) for line in (tmp_path / "run/schedule.jsonl").read_text().splitlines()]
    # the failed job's machine goes to the other job, which runs until its timeout
    assert [(e["job"], e["action"]) for e in events] == [
        ("short", "start"), ("long", "start"), ("short", "fail"), ("long", "join"),
        ("long", "fail")]
    assert events[3]["devices"] == events[0]["devices"]


def test_an_interrupt_stops_every_run(files, tmp_path, monkeypatch):
    cluster, jobs = files
    _stand_ins(monkeypatch, {"short": SCRIPTS["long"], "long": SCRIPTS["long"]})
    processes, real_run = [], executor._Run

    def recorded(process, *rest):
        processes.append(process)
        return real_run(process, *rest)

    def interrupt_at_the_second_start(line):
        if ": start " in line and len(processes) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(executor, "_Run", recorded)
    with pytest.raises(KeyboardInterrupt):
        api.schedule_run(cluster, jobs, out=tmp_path / "run", policy="fair",
                         progress=interrupt_at_the_second_start)
    assert len(processes) == 2 and all(p.poll() is not None for p in processes)


# `potluck schedule --run` in its own process, its jobs stand-ins that sleep, one of which
# ignores SIGTERM (so only the SIGKILL after the grace period ends it).
SCHEDULER = """
import sys
from potluck.multijob import executor
scripts = {{"short": "import time; time.sleep(60)",
            "long": "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                    "time.sleep(60)"}}
executor.STOP_GRACE_S = 1.0
executor._Executor._command = lambda self, job, run_dir: [sys.executable, "-c",
                                                          scripts[job.name]]
sys.argv = ["potluck", "schedule", "--cluster", {cluster!r}, "--jobs", {jobs!r}, "--run",
            "--out", {out!r}]
from potluck.cli import main
main()
"""


def _children(pid):
    """The live children of ``pid``, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(condition, bound_s):
    deadline = time.monotonic() + bound_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_no_job_outlives_the_scheduler_whether_terminated_or_killed(files, tmp_path, sig):
    cluster, jobs = files
    script = SCHEDULER.format(cluster=str(cluster), jobs=str(jobs), out=str(tmp_path / "run"))
    scheduler = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_for(lambda: len(_children(scheduler.pid)) == 2, 30.0)
        jobs_pids = _children(scheduler.pid)
        scheduler.send_signal(sig)
        _, err = scheduler.communicate(timeout=30.0)
        assert _wait_for(lambda: not any(_alive(pid) for pid in jobs_pids), 5.0)
    finally:
        scheduler.kill()
        scheduler.communicate()
    if sig == signal.SIGTERM:  # the runs stopped first, then one line and 128 + SIGTERM
        assert scheduler.returncode == 143, err
        assert err.strip().splitlines()[-1].startswith("potluck: error: stopped by SIGTERM")
        assert "Traceback" not in err


def test_running_jobs_keep_their_machines_where_the_policy_gives_them_none():
    spec = parse_cluster(CLUSTER)
    one, two = Allocation((("cpu", 1),)), Allocation((("cpu", 2),))
    # the policy would stop 'a' and give 'b' everything: 'a' keeps its machine, 'b' waits
    assert _keep_running({"b": two}, {"a": one}, spec) == {"a": one}
    # a newcomer fits beside the running job: both go
    assert _keep_running({"b": one}, {"a": one}, spec) == {"a": one, "b": one}
    # a running job grown into the machine a newcomer needs: the newcomer waits
    assert _keep_running({"a": two, "b": one}, {"a": one}, spec) == {"a": two}


def test_jobs_train_steps_in_proportion_to_their_tokens():
    shape = JobShape(None, None)
    jobs = [Job("a", shape, 2_000), Job("b", shape, 500), Job("c", shape, 1)]
    assert job_steps(jobs, 40) == {"a": 40, "b": 10, "c": 1}


@pytest.mark.parametrize(("flags", "says"), [
    (["--run"], "--run needs --out DIR"),
    (["--out", "x"], "--out DIR goes with --run"),
    (["--run", "--out", "x", "--steps", "0"], "--steps must be at least 1"),
    (["--run", "--out", "x", "--checkpoint-every", "0"], "--checkpoint-every must be at least 1"),
    (["--run", "--out", "x", "--json"], "--run launches a jobs file"),
])
def test_bad_run_flags_get_one_line_and_start_nothing(files, tmp_path, monkeypatch, capsys,
                                                      flags, says):
    cluster, jobs = files
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["potluck", "schedule", "-c", str(cluster), "--jobs",
                                      str(jobs), *flags])
    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code != 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("potluck: error: ") and says in lines[0]
    assert not (tmp_path / "x").exists()
