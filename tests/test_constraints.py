"""A fresh install gets what was tested: ``constraints.txt`` pins every dependency within
``pyproject.toml``'s ranges, the README's two commands and CI install through it, and the
upgrade tool reads and compares pins as pip writes them."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from upgrade_constraints import changes, pins  # noqa: E402

tomllib = pytest.importorskip("tomllib")
PINS = pins((ROOT / "constraints.txt").read_text())


def _direct_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(text) for text in
            [*project["dependencies"], *project["optional-dependencies"]["test"]]]


@pytest.mark.parametrize("requirement", _direct_requirements(), ids=str)
def test_every_direct_dependency_is_pinned_within_its_range(requirement: Requirement):
    name = re.sub(r"[-_.]+", "-", requirement.name).lower()
    assert name in PINS, f"{name} is not in constraints.txt: run tools/upgrade_constraints.py"
    assert requirement.specifier.contains(PINS[name], prereleases=True), (
        f"constraints.txt pins {name}=={PINS[name]}, outside pyproject's {requirement}")


def test_the_constraints_pin_releases_not_potluck_itself():
    assert "potluck" not in PINS
    assert all("+" not in version for version in PINS.values())  # any build of the release


def test_the_readme_commands_and_ci_install_through_the_constraints():
    commands = [line for line in (ROOT / "README.md").read_text().splitlines()
                if line.startswith("python3 -m venv .venv &&")]
    assert len(commands) == 2, commands
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(line for line in commands if "pytest" in line)
    assert test_command in ci
    for command in commands:
        assert ".venv/bin/pip install -c constraints.txt " in command


def test_pins_read_pip_freeze_as_releases_by_normalized_name():
    frozen = "Jinja2==3.1.6\ntorch==2.13.0+cpu\ntyping_extensions==4.16.0\n-e /work/potluck\n"
    assert pins(frozen) == {"jinja2": "3.1.6", "torch": "2.13.0", "typing-extensions": "4.16.0"}


def test_changes_name_every_package_added_removed_or_moved():
    old = {"transformers": "5.24.0", "torch": "2.13.0", "tomli": "2.0"}
    new = {"transformers": "5.25.0", "torch": "2.13.0", "kernels": "0.19.1"}
    assert changes(old, new) == ["+ kernels 0.19.1", "- tomli 2.0",
                                 "  transformers 5.24.0 -> 5.25.0"]
