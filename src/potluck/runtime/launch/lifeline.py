"""Ranks never outlive the launcher that started them.

A rank started by :func:`~potluck.runtime.launch.local.run_local` is a child
of the fork server (or, under spawn, of the launcher itself), and three ties
end it when what started it is gone:

- the kernel's parent-death signal (Linux ``PR_SET_PDEATHSIG``): SIGKILL the
  moment its direct parent dies, the fork server or the spawning launcher;
- a lifeline thread that watches the launcher itself, whatever the start
  method (a pidfd on Linux wakes it the moment the launcher exits; elsewhere
  it polls), and ends the rank with ``os._exit`` when the launcher is gone:
  nobody is left to read its result, and the store it rendezvoused on died
  with the launcher;
- SIGTERM restored to its default action, since a rank inherits an ignored
  or blocked SIGTERM from the process that started the launcher (exec keeps
  both): the launcher's SIGTERM, and a user's, then stop it.

A process started with :func:`dies_with_this_process` as its ``preexec_fn`` (a job that
``potluck schedule --run`` launches) gets the same parent-death signal before it execs,
so it ends with the process that started it even when that one is SIGKILLed.

Ctrl-C is the launcher's to handle (as torchrun's agent does): it stops the
ranks. The fork server and the ranks start with SIGINT blocked
(:func:`starting_processes`) and the ranks then ignore it, so a Ctrl-C while
they import torch prints no traceback from each of them.

The launcher holds each rank by a :class:`RankHandle` (a pidfd on Linux):
whether the rank is alive and the signals sent to it stay right after its
parent, the fork server, died and it was re-parented, where
``multiprocessing`` reports it dead, and never reach a process that reused
its pid. :func:`stop` terminates ranks, then kills those that ignore SIGTERM.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing.forkserver
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
POLL_S = 0.25
LAUNCHER_GONE_EXIT = 1


def die_with_launcher(launcher_pid: int) -> None:
    """In a rank: end this process when its parent or the launcher is gone, or on SIGTERM;
    leave Ctrl-C to the launcher."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    _set_parent_death_signal()
    threading.Thread(target=_watch_launcher, args=(launcher_pid,), name="potluck-lifeline",
                     daemon=True).start()


@contextmanager
def starting_processes() -> Iterator[None]:
    """Ctrl-C held back while this thread starts processes. SIGINT is blocked here, and the
    fork server, the resource tracker and spawned ranks keep that mask through exec, so a
    Ctrl-C cannot interrupt their imports with a traceback each. In the main thread, a
    Ctrl-C meanwhile is delivered once every process has started: an interrupted start
    leaves a process whose pid the launcher never learned, so cannot stop."""
    pending: list[int] = []
    deferred = (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is not None)  # None: not set from Python
    handler = signal.signal(signal.SIGINT, lambda *_: pending.append(1)) if deferred else None
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if deferred:
            signal.signal(signal.SIGINT, handler)
    if pending:
        signal.raise_signal(signal.SIGINT)


def dies_with_this_process() -> Callable[[], None]:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the child is SIGKILLed when this
    process dies, however it dies, and exits at once if it already has. Linux only
    (elsewhere it does nothing). The kernel ties the child to the *thread* that starts it:
    start it from a thread that lives as long as the child should (the main thread)."""
    parent_pid = os.getpid()
    prctl = _prctl()  # looked up here: between fork and exec only the call itself is safe

    def preexec() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before the signal was set
            os._exit(LAUNCHER_GONE_EXIT)

    return preexec


def _prctl() -> Any:
    """libc's ``prctl`` on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True).prctl


def _set_parent_death_signal() -> None:
    """SIGKILL this process when its parent dies (Linux only; the parent is the thread that
    forked it: the fork server's main thread, or the launcher thread that spawned it)."""
    prctl = _prctl()
    if prctl is not None and prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())


def _watch_launcher(launcher_pid: int) -> None:
    launcher = ProcessHandle(launcher_pid)
    launcher.wait_gone(None)
    log.debug("the launcher (pid %d) is gone; this rank exits", launcher_pid)
    os._exit(LAUNCHER_GONE_EXIT)


class ProcessHandle:
    """A process by pidfd where there are pidfds (Linux 5.3+), else by pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = None
        self._gone = False
        if hasattr(os, "pidfd_open"):
            try:
                self._fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._gone = True

    def alive(self) -> bool:
        return not self.wait_gone(0.0)

    def wait_gone(self, timeout_s: float | None) -> bool:
        """Whether the process has exited, waiting at most ``timeout_s`` (None: for ever)."""
        if self._gone:
            return True
        if self._fd is not None:
            self._gone = bool(select.select([self._fd], [], [], timeout_s)[0])
            return self._gone
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while _pid_alive(self.pid):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        self._gone = True
        return True

    def send(self, sig: int) -> None:
        if self._gone:
            return
        try:
            if self._fd is not None:
                signal.pidfd_send_signal(self._fd, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            self._gone = True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RankHandle(ProcessHandle):
    """A rank the launcher started: its multiprocessing process, and a handle that stays
    right when the process's parent (the fork server) dies."""

    def __init__(self, process: Any) -> None:
        super().__init__(process.pid)
        self.process = process
        self._by_pid = self._fd is not None

    def alive(self) -> bool:
        return super().alive() if self._by_pid else self.process.is_alive()

    def wait_gone(self, timeout_s: float | None) -> bool:
        if self._by_pid:
            return super().wait_gone(timeout_s)
        self.process.join(timeout_s)
        return not self.process.is_alive()


def stop(ranks: Sequence[RankHandle], wait_s: float) -> None:
    """SIGTERM the ranks still alive; SIGKILL those still alive ``wait_s`` later."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [rank for rank in ranks if rank.alive()]
        for rank in alive:
            rank.send(sig)
            rank.send(signal.SIGCONT)  # a stopped rank acts on SIGTERM only once continued
        deadline = time.monotonic() + wait_s
        for rank in alive:
            rank.wait_gone(max(0.0, deadline - time.monotonic()))
    for rank in ranks:
        rank.process.join(timeout=1.0)
        rank.close()


def fork_server_death() -> str | None:
    """How the fork server that starts the ranks died, or None while it runs (or there is
    none). Asks without reaping it, so ``multiprocessing`` still restarts it next time."""
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        return None
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return f"the fork server that starts the ranks (pid {pid}) is gone"
    if info is None:
        return None
    killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
    how = killed_by(info.si_status) if killed else f"exited with code {info.si_status}"
    return f"the fork server that starts the ranks (pid {pid}) {how}"


def killed_by(signal_number: int) -> str:
    """'was killed by signal 9 (SIGKILL)'."""
    try:
        name = f" ({signal.Signals(signal_number).name})"
    except ValueError:
        name = ""
    return f"was killed by signal {signal_number}{name}"
