"""Move ``constraints.txt`` to the newest releases, deliberately.

``constraints.txt`` holds every package a fresh install of ``potluck[test]`` resolves
(direct and transitive) at the version the test suite last passed with; the README's two
commands and ``.ci/run`` install with ``-c constraints.txt``, so a new machine gets exactly
the tested set and a release published after the last green CI cannot break it unseen.
This script is the one way forward:

1. a fresh virtual environment gets the newest releases ``pyproject.toml``'s ranges allow,
   beside the torch the constraints pin (``--torch`` to move torch too);
2. what changed against ``constraints.txt`` is listed;
3. the model-family tests run there (``--all``: the whole suite, as CI runs it);
4. only when they pass is ``constraints.txt`` rewritten; otherwise it stays as it is and the
   environment is kept for a look (its path is printed).

Usage: ``python tools/upgrade_constraints.py [--all] [--torch VERSION]`` (about 2 minutes
to install, 2 more for the family tests, 15-20 for ``--all`` on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
FAMILY_TESTS = ("tests/model", "tests/runtime/test_families.py", "tests/runtime/test_moe.py",
                "tests/runtime/test_expert_parallel.py")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")


def pins(text: str) -> dict[str, str]:
    """Package name (normalized as PEP 503 does) -> release, from ``name==version`` lines. A
    local label (torch's ``+cpu``) is the build, not the release: ``torch==2.13.0`` admits
    the CPU build tested here and the CUDA build of a GPU machine alike."""
    found = {}
    for line in text.splitlines():
        match = _PIN.match(line.strip())
        if match:
            name = re.sub(r"[-_.]+", "-", match.group(1)).lower()
            found[name] = match.group(2).split("+", 1)[0]
    return found


def changes(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """One line per package added, removed or moved, by name."""
    lines = []
    for name in sorted(old.keys() | new.keys()):
        before, after = old.get(name), new.get(name)
        if before == after:
            continue
        if before is None:
            lines.append(f"+ {name} {after}")
        elif after is None:
            lines.append(f"- {name} {before}")
        else:
            lines.append(f"  {name} {before} -> {after}")
    return lines


def render(new: dict[str, str], python: str, tested: str, day: datetime.date) -> str:
    """The constraints file: a header saying what it is and how it was made, then the pins."""
    header = [
        "# Every package a fresh install of potluck[test] resolves, at the version the tests",
        f"# last passed with ({tested}; Python {python}, the CPU build of torch {new.get('torch', '?')},",
        f"# {day.isoformat()}). The README's commands and .ci/run install with",
        "# `pip install -c constraints.txt ...`. Do not edit by hand: move forward with",
        "# `python tools/upgrade_constraints.py`, which rewrites this file only when the tests pass.",
    ]
    return "\n".join(header + [f"{name}=={version}" for name, version in sorted(new.items())]) + "\n"


def _run(command: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    began = time.monotonic()
    print(f"{what} ...", flush=True)
    done = subprocess.run(command, cwd=ROOT, text=True, **kwargs)
    print(f"{what}: {'done' if done.returncode == 0 else 'FAILED'} in "
          f"{time.monotonic() - began:.0f} s", flush=True)
    return done


def _install(venv: Path, torch: str) -> dict[str, str]:
    """The newest releases pyproject allows, in a fresh ``venv``; its pins."""
    _run([sys.executable, "-m", "venv", str(venv)], "creating a virtual environment", check=True)
    pip = str(venv / "bin" / "pip")
    _run([pip, "install", "-q", f"torch=={torch}", "-e", ".[test]"],
         "installing the newest releases (about 2 minutes)", check=True)
    frozen = _run([pip, "freeze", "--exclude-editable"], "reading the installed versions",
                  check=True, capture_output=True)
    return pins(frozen.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true",
                        help="run the whole suite, not only the model-family tests")
    parser.add_argument("--torch", help="the torch release to test (default: the pinned one)")
    args = parser.parse_args()
    old = pins(CONSTRAINTS.read_text()) if CONSTRAINTS.exists() else {}
    torch = args.torch or old.get("torch")
    if not torch:
        print("constraints.txt pins no torch; give one with --torch VERSION", file=sys.stderr)
        return 2
    venv = Path(tempfile.mkdtemp(prefix="potluck-constraints-")) / "venv"
    try:
        new = _install(venv, torch)
    except subprocess.CalledProcessError as err:
        print(f"{' '.join(map(str, err.cmd[:3]))} ... failed with exit code {err.returncode}: "
              "constraints.txt is unchanged", file=sys.stderr)
        return 1
    moved = changes(old, new)
    if not moved:
        print("no release moved: constraints.txt is current", flush=True)
        return 0
    print("\n".join(["changes against constraints.txt:", *moved]), flush=True)
    tests = [] if args.all else list(FAMILY_TESTS)
    what = "the whole suite" if args.all else "the model-family tests"
    ran = _run([str(venv / "bin" / "python"), "-m", "pytest", "-n", "2", "-q", *tests],
               f"running {what} on these releases")
    if ran.returncode != 0:
        print(f"tests failed: constraints.txt is unchanged; the environment is kept at {venv}",
              file=sys.stderr)
        return 1
    python = ".".join(map(str, sys.version_info[:2]))
    CONSTRAINTS.write_text(render(new, python, what, datetime.date.today()))
    print(f"wrote {CONSTRAINTS.relative_to(ROOT)} ({len(new)} packages); run the whole suite "
          "before committing if only the family tests ran", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
