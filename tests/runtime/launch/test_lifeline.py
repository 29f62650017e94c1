"""No rank outlives `potluck train`, and a run that loses a process says which, in one line.

Most tests start `potluck train` on two CPU ranks with stdout and stderr on pipes (as
`potluck train ... | tee log` has them), wait for its first step, kill one process of
the run (a rank, the fork server, the launcher) and check what the user sees: how
potluck exits, its stderr, and that no rank is left running. A rank left running would
also hold the pipes open, so reading them to the end is itself bounded. The others
check Ctrl-C during the start, a rank that ignores SIGTERM, and torch's C++ warnings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from potluck.runtime.launch.local import STOP_WAIT_S, run_local
from potluck.runtime.launch.watchdog import RankFailure

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]
SRC = Path(__file__).resolve().parents[3] / "src"
CLUSTER = "nodes: [{name: cpu, gpu: cpu, gpus_per_node: 2}]\n"
START_S = 240.0  # planning, importing torch, starting the ranks: slow on a loaded machine
GONE_S = 30.0  # how long potluck and its ranks may take to end once a process is killed
C_PLUS_PLUS_NOISE = ("TCPStore", "ProcessGroup", "c10d", "frame #", "[W", "[E")


@dataclass
class Run:
    launcher: subprocess.Popen
    fork_server: int
    ranks: list[int]

    def finish(self) -> tuple[int, list[str]]:
        """potluck's exit code and the lines of its stderr, read to the end, without the
        run's progress lines (``train: step k (d/N done) ...``, written there before the kill)."""
        try:
            _, err = self.launcher.communicate(timeout=GONE_S)
        except subprocess.TimeoutExpired:
            pytest.fail("potluck (or a rank holding its pipes) was still running "
                        f"{GONE_S:.0f} s after the kill")
        return self.launcher.returncode, [line for line in err.splitlines()
                                          if line.strip() and not line.startswith("train: ")]


@contextmanager
def training(tmp_path: Path, ignore_sigterm: bool = False) -> Iterator[Run]:
    """`potluck train` on two CPU ranks, after its first step; everything it started is
    killed afterwards whatever the test found."""
    cluster = tmp_path / "cpus.yaml"
    cluster.write_text(CLUSTER)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env.pop("TORCH_CPP_LOG_LEVEL", None)
    preexec = (lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN)) if ignore_sigterm else None
    launcher = subprocess.Popen(
        [sys.executable, "-m", "potluck", "train", "-c", str(cluster), "-m", "tiny-llama",
         "--steps", "100000", "--global-batch", "4", "--seq-len", "32", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=preexec)
    run = Run(launcher, 0, [])
    try:
        _wait_for_first_step(run, out / "metrics.jsonl")
        yield run
    finally:
        for pid in [launcher.pid, run.fork_server, *run.ranks]:
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.kill()
        launcher.communicate()


def _wait_for_first_step(run: Run, metrics: Path) -> None:
    deadline = time.monotonic() + START_S
    while not (metrics.exists() and metrics.read_text().strip()):
        assert run.launcher.poll() is None, run.launcher.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no training step within {START_S:.0f} s"
        time.sleep(0.5)
    servers = [p for p in _children(run.launcher.pid) if b"forkserver" in _cmdline(p)]
    assert len(servers) == 1, "the launcher should start its ranks from one fork server"
    run.fork_server = servers[0]
    run.ranks = _children(run.fork_server)
    assert len(run.ranks) == 2


def _children(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return sorted(children)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _gone_soon(pids: list[int], within_s: float = GONE_S) -> list[int]:
    """The pids still running ``within_s`` from now (none, if they end in time)."""
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _no_noise(lines: list[str]) -> None:
    noise = [line for line in lines if any(word in line for word in C_PLUS_PLUS_NOISE)]
    assert not noise, "\n".join(noise[:5])


def test_a_killed_fork_server_is_named_and_takes_every_rank_with_it(tmp_path):
    with training(tmp_path) as run:
        os.kill(run.fork_server, signal.SIGKILL)
        code, lines = run.finish()
        assert _gone_soon(run.ranks) == []
    assert code != 0
    assert len(lines) == 1, "\n".join(lines[:20])
    assert lines[0].startswith("potluck: error: the fork server that starts the ranks "
                               f"(pid {run.fork_server}) was killed by signal 9")
    assert "rank 0" not in lines[0] and "rank 1" not in lines[0]


def test_ranks_end_with_a_killed_launcher_even_while_their_fork_server_lives(tmp_path):
    """The fork server is stopped (it cannot exit, so its ranks' parent-death signal never
    fires): only the ranks' own watch on the launcher can end them."""
    with training(tmp_path) as run:
        os.kill(run.fork_server, signal.SIGSTOP)
        os.kill(run.launcher.pid, signal.SIGKILL)
        assert _gone_soon(run.ranks) == [], "ranks outlived their launcher"
        os.kill(run.fork_server, signal.SIGKILL)  # it holds the pipes too
        code, lines = run.finish()
    assert code == -signal.SIGKILL
    _no_noise(lines)


def test_a_rank_stopped_with_sigterm_is_one_line_even_if_the_launcher_ignores_sigterm(
        tmp_path):
    """Ignored signals pass through exec to the fork server and the ranks; a rank must
    still stop when told to."""
    with training(tmp_path, ignore_sigterm=True) as run:
        os.kill(run.ranks[1], signal.SIGTERM)
        code, lines = run.finish()
        assert _gone_soon(run.ranks) == []
    assert code != 0
    assert len(lines) == 1, "\n".join(lines[:20])
    assert lines[0] == "potluck: error: rank 1 (cpu.0:1) was killed by signal 15 (SIGTERM)"
    _no_noise(lines)


def _stuck_or_failing(pid_dir: str) -> None:
    """Rank 0 ignores SIGTERM and never returns; rank 1 fails once rank 0 is stuck."""
    rank = int(os.environ["RANK"])
    if rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        Path(pid_dir, "stuck.pid").write_text(str(os.getpid()))
        while True:
            time.sleep(1)
    while not Path(pid_dir, "stuck.pid").exists():
        time.sleep(0.1)
    raise ValueError("injected failure")


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    began = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 \(cpu\.0:1\) failed: ValueError: injected"):
        run_local(_stuck_or_failing, ["cpu.0:0", "cpu.0:1"], (str(tmp_path),), grace_s=1.0,
                  timeout_s=START_S)
    stuck = int((tmp_path / "stuck.pid").read_text())
    assert not _alive(stuck), "run_local returned while a rank still ran"
    assert time.monotonic() - began < START_S


def _as_in_a_terminal() -> None:
    """Ctrl-C at its default action, as in a terminal's foreground job. Started in the
    background of a non-interactive shell (``.ci/run &``, ``nohup``), the test run ignores
    SIGINT, an ignored signal passes through exec, and the launcher then rightly ignores
    Ctrl-C as well (Python installs its handler only where SIGINT is not ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _descendants(pid: int) -> list[int]:
    found = _children(pid)
    return found + [grandchild for child in found for grandchild in _descendants(child)]


def _sigint(pid: int) -> str:
    """How ``pid`` takes SIGINT (default, caught or ignored; blocked in its main thread)."""
    try:
        status = dict(line.split(":\t", 1) for line in
                      Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    except OSError:
        return "gone"
    bit = 1 << (signal.SIGINT - 1)
    how = ("ignored" if int(status["SigIgn"], 16) & bit
           else "caught" if int(status["SigCgt"], 16) & bit else "default")
    return how + (", blocked" if int(status["SigBlk"], 16) & bit else "")


def _still_running(pids: list[int]) -> str:
    lines = []
    for pid in filter(_alive, pids):
        command = _cmdline(pid).replace(b"\0", b" ").decode(errors="replace")
        lines.append(f"pid {pid} (SIGINT {_sigint(pid)}): {command[:120]}")
    return "\n".join(lines)


# What the launcher promises after Ctrl-C: it acts once every rank has started (a Ctrl-C
# during the start is held back, :func:`potluck.runtime.launch.lifeline.starting_processes`),
# then stops the ranks: SIGTERM, SIGKILL STOP_WAIT_S later, STOP_WAIT_S more to see them go.
CTRL_C_STOPS_S = START_S + 2 * STOP_WAIT_S + GONE_S


def test_ctrl_c_while_the_ranks_start_stops_them_without_a_traceback(tmp_path):
    """Ctrl-C reaches every process of the terminal's foreground group: the fork server, still
    importing torch, and the ranks must leave stopping to the launcher."""
    cluster = tmp_path / "cpus.yaml"
    cluster.write_text(CLUSTER)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "potluck", "train", "-c", str(cluster), "-m", "tiny-llama",
         "--steps", "100000", "--global-batch", "4", "--seq-len", "32"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)}, start_new_session=True,
        preexec_fn=_as_in_a_terminal)
    started: list[int] = []
    try:
        deadline = time.monotonic() + START_S
        while not started and time.monotonic() < deadline and launcher.poll() is None:
            started = [p for p in _children(launcher.pid) if b"forkserver" in _cmdline(p)]
            time.sleep(0.05)
        assert started, "no fork server started"
        os.killpg(launcher.pid, signal.SIGINT)
        try:
            _, err = launcher.communicate(timeout=CTRL_C_STOPS_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {CTRL_C_STOPS_S:.0f} s after Ctrl-C:\n"
                        + _still_running([launcher.pid, *_descendants(launcher.pid)]))
        assert _gone_soon(started + _children(started[0])) == []
    finally:
        with suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.communicate()
    assert launcher.returncode != 0
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]


def _store_gone() -> str:
    """What a rank's store client says when the store's server is gone (the launcher that
    hosts it died); torch also logs a warning with a C++ stack trace."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                           timeout=timedelta(seconds=5))
    client.set("key", "1")
    del server
    try:
        client.add("key", 1)
    except dist.DistNetworkError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("level", [None, "WARNING"])
def test_ranks_log_torchs_cpp_warnings_only_when_asked_to(tmp_path, level):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(Path(__file__).parent)])}
    env.pop("TORCH_CPP_LOG_LEVEL", None)
    if level:
        env["TORCH_CPP_LOG_LEVEL"] = level
    script = ("from potluck.runtime.launch.local import run_local\n"
              "from test_lifeline import _store_gone\n"
              "print(run_local(_store_gone, ['cpu.0:0'])[0])\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=START_S, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Connection was likely closed" in result.stdout  # the error itself stays
    assert ("recvValue failed" in result.stderr) == (level == "WARNING"), result.stderr[-3000:]


def _crashes_in_c() -> None:
    os.abort()  # what glibc does on a corrupted heap: SIGABRT from C, no Python exception


def test_a_rank_that_crashes_in_c_leaves_its_python_stack_on_stderr(tmp_path):
    """A heap corruption or segfault in torch's C++ gives no Python traceback by itself; the
    rank's stack is what tells a maintainer which step it was in."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(Path(__file__).parent)])}
    env.pop("PYTHONFAULTHANDLER", None)
    script = ("from potluck.runtime.launch.local import run_local\n"
              "from test_lifeline import _crashes_in_c\n"
              "run_local(_crashes_in_c, ['cpu.0:0'])\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=START_S, cwd=tmp_path)
    assert result.returncode != 0
    assert "Fatal Python error: Aborted" in result.stderr, result.stderr[-3000:]
    assert "in _crashes_in_c" in result.stderr, result.stderr[-3000:]
