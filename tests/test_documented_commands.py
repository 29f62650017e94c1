"""Every ``potluck`` command shown in a code block of the README or docs/ parses as written:
the app reads its command, options and arguments (nothing runs), so a doc cannot teach a
command line that fails with a usage error."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)


def _command_lines(path: Path) -> list[str]:
    """``potluck ...`` lines of the file's code blocks, comments dropped."""
    found = []
    for block in _code_blocks(path.read_text()):
        for line in block.splitlines():
            for part in line.split("#")[0].split("&&"):
                words = part.strip().removeprefix(".venv/bin/")
                if words.startswith("potluck ") and words[8:9].isalpha():
                    found.append(words)
    return found


def _as_written(line: str) -> list[str]:
    """The words of a documented line: optional parts ``[...]`` included, the first of
    ``a|b|c`` choices, a count ``N`` as 1, other placeholders (``RUN_DIR``) as they are."""
    line = line.replace("[", " ").replace("]", " ")
    words = [word.split("|")[0] if not word.startswith("--") else word
             for word in shlex.split(line)[1:]]
    return ["1" if word == "N" else word for word in words]


DOCUMENTED = [(path.relative_to(ROOT).as_posix(), line) for path in DOCS
              for line in _command_lines(path)]


def test_the_docs_show_commands():
    assert len(DOCUMENTED) > 30
    assert {"potluck train", "potluck plan", "potluck simulate"} <= {
        " ".join(line.split()[:2]) for _, line in DOCUMENTED}


@pytest.mark.parametrize(("source", "line"), DOCUMENTED)
def test_a_documented_command_parses(source, line):
    import typer

    from potluck.cli import app

    command = typer.main.get_command(app)
    args = _as_written(line)
    assert args and args[0] in command.commands, f"{source}: {line}"
    sub = command.commands[args[0]]
    with sub.make_context(f"potluck {args[0]}", args[1:]) as ctx:
        assert ctx.params is not None
