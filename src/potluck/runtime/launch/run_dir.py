"""A run directory (``potluck train --out DIR``): what shows that it holds a run, and who
may train into it.

A run leaves ``plan.json``, ``metrics.jsonl`` and ``checkpoints/`` there, and perhaps
``trace.json`` (and ``potluck compare``'s ``predicted.json`` and ``side_by_side.json``
beside it), ``tensorboard/``, an elastic run's ``replans.jsonl``, and the CPU measurement
its plan was made with. A second run trained into the same directory would mix with the
first: ``metrics.jsonl`` cut to the new run's rows,
the old run's later checkpoints kept over the new one's, ``potluck export`` taking the old
run's last step, a later ``--resume`` continuing a mix of both. So :func:`claim_run_dir`,
which the launcher calls once every check has passed and before any rank starts, refuses
a directory that holds a run unless the run continues it (``--resume``) or replaces it
(``--overwrite``: the old run's files are deleted first, never through a link).
A ``plan.json`` alone (``potluck plan -o DIR/plan.json``, the torchrun commands' plan) is
not a run, nor are devices offered before the run starts (``potluck join``).
"""

from __future__ import annotations

from pathlib import Path

from potluck.errors import ConfigError
from potluck.runtime.checkpoints.names import CHECKPOINTS_DIR, newest_step_dir
from potluck.runtime.options import TrainOptions
from potluck.safe_files import check_no_link, remove_tree

PLAN_FILE = "plan.json"  # the plan a run directory was trained with
# What a run writes besides its plan (names as their writers spell them: loop/metrics.py,
# checkpoints/storage.py, timing/recorder.py, calibrate/compare_run.py, elastic/replans.py,
# profiler/quick.py).
RUN_FILES = ("metrics.jsonl", CHECKPOINTS_DIR, "trace.json", "predicted.json",
             "side_by_side.json", "tensorboard", "replans.jsonl")
LAUNCH_FILES = (PLAN_FILE, "cpu_measured.json")  # written before the first step
# Devices offered to or taken from an elastic run (elastic/joins.py): ``potluck join`` may
# write them before the run starts, so they are no sign of another run, and stay.
OFFER_FOLDERS = ("joined", "leaving")


def run_files(run_dir: str | Path) -> list[Path]:
    """The files and folders of a run in ``run_dir`` (none: it holds no run)."""
    root = Path(run_dir)
    return [root / name for name in RUN_FILES if (root / name).is_symlink()
            or (root / name).exists()]


def check_no_links(run_dir: str | Path) -> None:
    """None of a run's files or folders in ``run_dir`` is a symbolic link (potluck would
    refuse to write through it once the run had trained: say so before it starts)."""
    for name in (*RUN_FILES, *LAUNCH_FILES, *OFFER_FOLDERS):
        check_no_link(Path(run_dir) / name, run_dir)


def check_run_dir(options: TrainOptions) -> None:
    """A run may train into ``options.out_dir``: no link among a run's files there, and no
    other run unless ``options.resume`` or ``options.overwrite`` (``potluck train`` checks
    this before it plans, the launcher again before it deletes anything)."""
    if options.out_dir is None:
        return
    check_resume_or_overwrite(options)
    check_no_links(options.out_dir)
    found = run_files(options.out_dir)
    if found and not options.resume and not options.overwrite:
        raise ConfigError(
            f"--out {options.out_dir} holds another run ({_describe(found)}); continue it with "
            "--resume, replace it with --overwrite (its files are deleted first), or give "
            "another --out")


def claim_run_dir(options: TrainOptions) -> None:
    """Let a run train into ``options.out_dir`` (:func:`check_run_dir`); with
    ``options.overwrite`` the other run's files there are deleted now."""
    check_run_dir(options)
    if options.out_dir is None or options.resume:
        return
    found = run_files(options.out_dir)
    if not found:
        return
    root = Path(options.out_dir)
    for path in [*found, *(root / name for name in LAUNCH_FILES)]:
        remove_tree(path, root, missing_ok=True)


def check_resume_or_overwrite(options: TrainOptions) -> None:
    """--resume and --overwrite exclude each other."""
    if options.resume and options.overwrite:
        raise ConfigError("--resume continues the run in --out DIR and --overwrite deletes it; "
                          "give one of them")


def _describe(found: list[Path]) -> str:
    """``metrics.jsonl, checkpoints/ up to step 40``."""
    names = [path.name + ("/" if path.is_dir() else "") for path in found]
    newest = newest_step_dir(found[0].parent)
    if newest is not None and f"{CHECKPOINTS_DIR}/" in names:
        names[names.index(f"{CHECKPOINTS_DIR}/")] += f" up to step {newest}"
    return ", ".join(names)
