"""Imported only by the fork server that starts the ranks (first of
:data:`~potluck.runtime.launch.local.PRELOAD`): one line instead of a traceback when the
launcher dies while the fork server starts a rank for it.

A rank the fork server forks first reads what to run from the launcher through a pipe;
a launcher killed at that moment (an elastic restart, a SIGTERM or SIGKILL mid-start)
leaves the pipe empty, ``multiprocessing`` raises ``EOFError`` there, and the fork server
hands it to :data:`sys.excepthook`, which would print the whole stack of
``multiprocessing``'s internals on the user's terminal. This module's hook says it in one
line; every other error keeps Python's traceback. (Ranks that did start report their own
errors through the launcher: :func:`~potluck.runtime.launch.local._rank_main`.)
"""

from __future__ import annotations

import sys
from types import TracebackType

LAUNCHER_GONE = ("potluck: a rank was being started when its launcher exited; "
                 "the rank did not start")


def launcher_gone_in_one_line(kind: type[BaseException], error: BaseException,
                              trace: TracebackType | None) -> None:
    """:data:`sys.excepthook`: an ``EOFError`` (the launcher's pipe closed) in one line."""
    if issubclass(kind, EOFError):
        sys.stderr.write(LAUNCHER_GONE + "\n")
        return
    sys.__excepthook__(kind, error, trace)


sys.excepthook = launcher_gone_in_one_line
