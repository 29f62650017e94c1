"""Settings every test shares: no progress lines off a terminal (``POTLUCK_PROGRESS=0``), so
that a command slowed by a busy machine writes the same stderr as on an idle one; the tests
of progress lines turn them back on."""

from __future__ import annotations

import pytest

from potluck.console.progress import QUIET_ENV


@pytest.fixture(autouse=True)
def _no_progress_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(QUIET_ENV, "0")


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder this user cannot write into (mode 0o500); skipped where the user still can
    (root, unless it has given up CAP_DAC_OVERRIDE)."""
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    try:
        (folder / "probe").write_text("")
    except PermissionError:
        return folder
    pytest.skip("this user writes into read-only folders (root)")
