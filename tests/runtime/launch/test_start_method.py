"""Ranks start whatever the launching process did with CUDA.

A process forked from one that initialized CUDA cannot use CUDA. The local launcher's
fork server must therefore never import the caller's module (a GPU test's skip marker
calls ``torch.cuda.is_available()`` when imported), and GPU runs spawn their ranks.
``cuda_at_import`` leaves the same mark a CUDA build does, so a CPU machine can tell."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import subprocess
import sys
from pathlib import Path

import pytest

from potluck.runtime.launch.gpus import StartMethod
from potluck.runtime.launch.local import PRELOAD, _method, run_local, start_context

SRC = Path(__file__).resolve().parents[3] / "src"
HERE = Path(__file__).resolve().parent
START_S = 240.0  # importing torch in a fresh interpreter, starting the ranks: a loaded machine
POTLUCK_TORCH_TRANSFORMERS = ("potluck.", "torch", "transformers")


def _rank() -> int:
    return int(os.environ["RANK"])


def test_the_fork_server_preloads_no_user_module():
    start_context(StartMethod.FORK_SERVER)
    assert run_local(_rank, ["cpu.0:0", "cpu.0:1"], timeout_s=START_S) == [0, 1]
    preloaded = multiprocessing.forkserver._forkserver._preload_modules
    assert preloaded == list(PRELOAD)
    assert all(name.startswith(POTLUCK_TORCH_TRANSFORMERS) for name in preloaded), preloaded


def test_a_function_of_the_main_script_is_spawned():
    """A fork server that has not imported the caller's script cannot unpickle its
    functions; spawn imports the script in each rank, as multiprocessing does."""
    def in_a_script() -> None:
        pass

    in_a_script.__module__ = "__main__"
    assert _method(in_a_script, None) is StartMethod.SPAWN
    assert _method(in_a_script, StartMethod.FORK_SERVER) is StartMethod.SPAWN
    assert _method(_rank, None) is StartMethod.FORK_SERVER
    assert _method(_rank, StartMethod.SPAWN) is StartMethod.SPAWN


def _python(script: str) -> subprocess.CompletedProcess:
    """A fresh interpreter (so a fresh fork server) that can import this folder's modules,
    as the fork server can then too."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE)])}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=START_S)


@pytest.mark.slow
@pytest.mark.parametrize("method", [None, "SPAWN"], ids=["default", "spawn"])
def test_ranks_start_when_the_parent_and_the_functions_module_touched_cuda(method):
    """The launching process imported ``cuda_at_import`` (it called ``is_available()``), and
    the ranks run a function of that module that fails in a poisoned fork."""
    keyword = f", start_method=StartMethod.{method}" if method else ""
    result = _python(
        "import cuda_at_import\n"
        "from potluck.runtime.launch.gpus import StartMethod\n"
        "from potluck.runtime.launch.local import run_local\n"
        "print(run_local(cuda_at_import.rank_sum, ['cpu.0:0', 'cpu.0:1'], timeout_s=120"
        f"{keyword}))\n")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[2.0, 2.0]"


CUDA_CALLS = ("is_available", "device_count", "init", "_lazy_init", "current_device",
              "set_device", "get_device_properties", "get_device_capability",
              "get_device_name", "is_bf16_supported", "mem_get_info")


@pytest.mark.slow
def test_the_fork_servers_modules_touch_no_cuda_when_imported():
    """Every CUDA query torch offers is replaced by a recorder before the fork server's
    modules are imported; none may be called."""
    result = _python(
        "import torch, torch.cuda\n"
        "calls = []\n"
        f"for name in {CUDA_CALLS!r}:\n"
        "    setattr(torch.cuda, name, lambda *a, _n=name, **k: calls.append(_n))\n"
        "from potluck.runtime.launch.local import PRELOAD\n"
        "for module in PRELOAD:\n"
        "    __import__(module)\n"
        "print(calls)\n")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


# The launcher dies (SIGKILL) after asking the fork server for a rank and before sending it
# what to run, as one killed during an elastic restart does; the fork server preloads only
# the hook of PRELOAD that says so (torch would make it slow to start).
HOOK = "potluck.runtime.launch.fork_server_hook"
LAUNCHER_DIES_MID_START = f"""
import multiprocessing, multiprocessing.forkserver as forkserver, os, signal, time
context = multiprocessing.get_context("forkserver")
context.set_forkserver_preload([{HOOK!r}])
warm = context.Process(target=time.sleep, args=(0.0,))
warm.start()
warm.join()
real = forkserver.connect_to_new_process
def dying(fds):
    asked = real(fds)
    time.sleep(1.0)  # the fork server forks the rank, which waits for what to run
    os.kill(os.getpid(), signal.SIGKILL)
forkserver.connect_to_new_process = dying
context.Process(target=time.sleep, args=(0.0,)).start()
"""


def test_a_launcher_killed_while_it_starts_a_rank_leaves_one_line_not_a_traceback():
    assert HOOK in PRELOAD
    result = _python(LAUNCHER_DIES_MID_START)
    assert result.returncode == -9
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    assert "potluck: a rank was being started when its launcher exited" in lines[0]
