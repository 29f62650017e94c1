"""(i) (g) and (h) again under CUDA's stream sanitizer, on a tiny model.

``TORCH_CUDA_SANITIZER=1`` makes ``import torch`` enable CSAN
(``torch/__init__.py``; :mod:`torch.cuda._sanitizer`): every kernel's tensor accesses are
checked against the streams and events ordering them, and an access that races with
another stream's (swap's and offload's side-stream copies) raises in the op. It checks in
Python, so the model is tiny; it runs this script itself with ``--only g,h --tiny`` in a
subprocess (whose spawned ranks inherit the variable), bounded by ``SANITIZER_TIMEOUT_S``.
"""

from __future__ import annotations

import os
import subprocess
import sys

from gpu_check_parts.common import REPO, SCRIPT, Outcome

SANITIZER_TIMEOUT_S = 150.0
SANITIZER_ENV = {"TORCH_CUDA_SANITIZER": "1"}


def sanitizer_command(device: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--device", device, "--only", "g,h", "--tiny"]


def sanitizer_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "src"), **SANITIZER_ENV}


def run_sanitized(device: str, timeout_s: float) -> Outcome:
    try:
        done = subprocess.run(sanitizer_command(device), cwd=REPO, env=sanitizer_env(),
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Outcome("g, h under TORCH_CUDA_SANITIZER", False,
                       f"did not finish within {timeout_s:.0f} s")
    return Outcome("g, h under TORCH_CUDA_SANITIZER", done.returncode == 0,
                   sanitizer_detail(done.stdout + done.stderr, done.returncode))


def sanitizer_detail(output: str, returncode: int) -> str:
    """The run's summary line, and CSAN's first report if it found a race."""
    lines = [line for line in output.splitlines() if line.strip()]
    race = next((line for line in lines if "CSAN detected a possible data race" in line), None)
    summary = next((line for line in reversed(lines) if "checks passed" in line),
                   lines[-1] if lines else f"exit code {returncode}")
    return f"{race.strip()}; {summary}" if race else summary
