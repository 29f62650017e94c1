"""Runtime tests run their math on one thread: on a small, shared CPU, several
threads per process fight each other and a 10 ms training step takes a second.

The tests sit in folders like the runtime's (launch/, grads/, checkpoints/,
timing/, loop/); their shared helpers (runtime_helpers, dist_harness,
dp_workers) sit here, importable by name from every folder below (pytest puts
this folder on the path when it loads this file, and spawned ranks inherit it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
