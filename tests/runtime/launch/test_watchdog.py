"""A rank that dies or hangs is named within seconds, even when the others never see an error.

Under NCCL a surviving rank blocks in a host sync and nothing raises in Python; the
multi-rank tests stand in for that with a store wait that never returns. The heartbeat
thread must notice the dead or silent rank itself, stop its process and name the culprit,
and must not mistake a long step or a rank that finished first for a death. The unit tests
drive :class:`Watchdog` threads in this process, on a real store, with ``end`` recording
the note instead of ending the process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from blocking_rank import all_started, block_forever
from runtime_helpers import TINY_LLAMA, make_plan, pipe

from potluck.cluster.spec import parse_cluster
from potluck.errors import ConfigError
from potluck.plans import save_plan
from potluck.runtime.launch.local import free_port, run_local
from potluck.runtime.launch.session import start
from potluck.runtime.launch.watchdog import JobNotes, RankFailure, Watchdog, silence_from_env

SILENCE_S = 3.0
BOUND_S = 60.0  # expected: a few seconds after start-up


def _two_rank_plan():
    return make_plan(TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 2)])


def _one_dies_while_the_other_blocks(plan, victim: int, how: str) -> None:
    session = start(plan, timeout_s=3600, silence_s=SILENCE_S)
    all_started(session.rank, plan.num_gpus)
    if session.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(3600)
    block_forever()


@pytest.mark.parametrize("how, named", [
    ("kill", r"^rank 1 \(cpu\.0:1\) was killed by signal 9"),
    ("stop", r"^rank 1 \(cpu\.0:1\) stopped responding \(no heartbeat for 3 s\); "
             r"the launcher killed it"),
], ids=["killed", "stopped"])
def test_a_rank_that_dies_or_stops_while_the_others_block_is_named_and_lost(how, named):
    """The launcher's grace period (90 s) and timeout are longer than the bound: only the
    survivor's own watchdog, and for a stopped rank the launcher killing it once the
    watchdog names it, can end it in time. Either way its device is lost (an elastic run
    plans around it) and no process of it is left."""
    plan = _two_rank_plan()
    began = time.monotonic()
    with pytest.raises(RankFailure, match=named) as failure:
        run_local(_one_dies_while_the_other_blocks, plan.devices, (plan, 1, how),
                  grace_s=90.0, timeout_s=2 * BOUND_S)
    assert time.monotonic() - began < BOUND_S
    assert failure.value.lost_devices == ("cpu.0:1",)


def _finishes_early_or_computes_long(plan) -> int:
    session = start(plan, timeout_s=3600, silence_s=SILENCE_S)
    if session.rank == 0:
        time.sleep(3 * SILENCE_S)  # a long step: the main thread is busy, the heartbeat is not
    session.close()
    return session.rank


def test_a_long_step_or_a_rank_that_finished_first_is_not_a_death():
    plan = _two_rank_plan()
    assert run_local(_finishes_early_or_computes_long, plan.devices, (plan,),
                     timeout_s=2 * BOUND_S) == [0, 1]


TWO_MACHINES = parse_cluster("nodes:\n  - {name: big, gpu: cpu, gpus_per_node: 1}\n"
                             "  - {name: small, gpu: cpu, gpus_per_node: 1}\n", "two.yaml")
HERE = Path(__file__).resolve().parent
START_S = 240.0  # two torchrun agents and their ranks importing torch: a loaded machine


@pytest.mark.slow
def test_under_torchrun_a_rank_whose_machine_lost_a_rank_names_it_itself(tmp_path):
    """No local launcher: when rank 1 (on the second machine) is killed, that machine's
    torchrun agent ends; rank 0, blocked on the first machine, must stop on its own and
    say why in its log."""
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 2)],
                     cluster=TWO_MACHINES, device_ids=["big.0:0", "small.0:0"])
    save_plan(plan, tmp_path / "plan.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "POTLUCK_SILENCE_S": str(SILENCE_S),
           "PYTHONPATH": os.pathsep.join([str(HERE.parents[2] / "src"), str(HERE)])}
    port = free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}",
         "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
         str(HERE / "blocking_rank.py"), str(tmp_path / "plan.json"), "1"],
        env={**env, "POTLUCK_NODE": node}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for rank, node in enumerate(["big.0", "small.0"])]
    try:
        output, _ = agents[0].communicate(timeout=START_S)
    finally:
        for agent in agents:
            agent.kill()
            agent.communicate()
    assert agents[0].returncode != 0
    assert ("rank 1 (small.0:0) stopped responding (no heartbeat for 3 s); "
            "rank 0 (big.0:0) stops") in output, output[-3000:]


class _Ended:
    """Stands in for ending the process: records the note."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.event = threading.Event()

    def __call__(self, note: str) -> None:
        self.notes.append(note)
        self.event.set()


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _watchdogs(store, world: int, started, silence_s: float = 1.0, notice_s: float = 0.2):
    devices = tuple(f"cpu.0:{r}" for r in range(world))
    dogs = {r: Watchdog(store, r, devices, silence_s=silence_s, interval_s=0.1,
                        notice_s=notice_s, end=_Ended())
            for r in range(world)}
    for rank in started:
        dogs[rank].start()
    return dogs


def _stop_all(dogs) -> None:
    for dog in dogs.values():
        dog._stop.set()


def test_a_rank_that_never_beats_is_named_by_its_watcher(store):
    dogs = _watchdogs(store, 2, started=[0])
    try:
        assert dogs[0]._end.event.wait(BOUND_S)
        assert dogs[0]._end.notes == ["rank 1 (cpu.0:1) stopped responding (no heartbeat for 1 s)"]
    finally:
        _stop_all(dogs)


def test_a_rank_that_stopped_on_purpose_is_not_named_and_the_next_one_is_watched(store):
    """Rank 0 watches ranks 1 and 2; once rank 1 has finished it watches 2 and 3, and rank 3
    is dead (never beats)."""
    dogs = _watchdogs(store, 4, started=[0, 1, 2])
    try:
        dogs[1].stop()
        assert dogs[0]._end.event.wait(BOUND_S) and dogs[2]._end.event.wait(BOUND_S)
        for rank in (0, 2):
            assert dogs[rank]._end.notes == [
                "rank 3 (cpu.0:3) stopped responding (no heartbeat for 1 s)"]
        assert not dogs[1]._end.notes
    finally:
        _stop_all(dogs)


def test_a_published_failure_ends_every_other_rank(store):
    dogs = _watchdogs(store, 3, started=[0, 1, 2], silence_s=600.0)
    try:
        JobNotes(store).publish("rank 2 (cpu.0:2) was killed by signal 9 (SIGKILL)")
        for rank in range(3):
            assert dogs[rank]._end.event.wait(BOUND_S)
            assert dogs[rank]._end.notes == ["rank 2 (cpu.0:2) was killed by signal 9 (SIGKILL)"]
    finally:
        _stop_all(dogs)


def test_the_main_thread_gets_time_to_meet_a_published_failure_itself(store):
    """With gloo a survivor's collective fails soon after the note appears, and the error
    should take the ordinary path (a RankFailure raised where the run can report it)."""
    dogs = _watchdogs(store, 2, started=[0, 1], silence_s=600.0, notice_s=2.0)
    try:
        JobNotes(store).publish("rank 2 (cpu.0:2) was killed by signal 9 (SIGKILL)")
        assert not dogs[0]._end.event.wait(0.5), "the main thread may notice first"
        error = dogs[0].diagnose(RuntimeError("Connection closed by peer"))
        assert str(error) == "rank 2 (cpu.0:2) was killed by signal 9 (SIGKILL)"
        assert dogs[1]._end.event.wait(BOUND_S), "a main thread that never notices is ended"
        assert not dogs[0]._end.event.wait(1.0), "one that noticed gets silence_s to stop"
    finally:
        _stop_all(dogs)


def test_a_main_thread_that_handles_the_failure_gets_time_to_stop_first(store):
    dogs = _watchdogs(store, 2, started=[0, 1], silence_s=2.0)
    try:
        dogs[0].mark_failed(ValueError("injected"))
        assert dogs[1]._end.event.wait(BOUND_S)
        assert dogs[1]._end.notes == ["rank 0 (cpu.0:0) failed: ValueError: injected"]
        assert not dogs[0]._end.event.wait(0.5), "the failing rank's own thread waits"
        assert dogs[0]._end.event.wait(BOUND_S), "...but not for ever"
    finally:
        _stop_all(dogs)


def _wait_in_vain(client: dist.Store, timeout_s: float) -> None:
    try:
        client.wait(["never-set"], timedelta(seconds=timeout_s))
    except dist.DistError:
        pass  # timed out, or the test's store closed


def test_the_heartbeat_goes_on_while_the_main_thread_blocks_in_the_store(store):
    """A store client serves one request at a time: a main thread waiting on a key (as
    NCCL's set-up does) would hold up a heartbeat on the same connection."""
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                           timeout=timedelta(seconds=BOUND_S))
    blocked = threading.Thread(target=_wait_in_vain, args=(client, 2 * BOUND_S), daemon=True)
    blocked.start()
    time.sleep(0.5)
    dog = Watchdog.connect(dist.PrefixStore("default_pg", client), 0, ("cpu.0:0",))
    dog.start()
    try:
        notes = JobNotes(store)
        deadline = time.monotonic() + BOUND_S
        while notes.beats(0) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert notes.beats(0) >= 3
    finally:
        dog.stop()
        store.set("never-set", "1")  # ends the wait
        blocked.join(BOUND_S)


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf"])
def test_a_bad_silence_setting_is_one_clear_error(monkeypatch, value):
    monkeypatch.setenv("POTLUCK_SILENCE_S", value)
    with pytest.raises(ConfigError, match=f"POTLUCK_SILENCE_S={value} must be a number"):
        silence_from_env()
    monkeypatch.setenv("POTLUCK_SILENCE_S", "12.5")
    assert silence_from_env() == 12.5
