"""Runtime tests run their math on one thread: on a small, shared CPU, several
threads per process fight each other and a 10 ms training step takes a second."""

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
