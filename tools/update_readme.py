"""Paste benchmark output files into the README between ``<!-- bench:NAME -->`` markers.

Usage: python tools/update_readme.py NAME=path/to/output.md [NAME=...]
(each output is what ``python benchmarks/NAME.py`` printed)
"""

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def paste(text: str, name: str, table: str) -> str:
    pattern = re.compile(rf"(<!-- bench:{name} -->\n).*?(<!-- /bench -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"README has no <!-- bench:{name} --> block")
    return pattern.sub(lambda m: m.group(1) + table.strip() + "\n" + m.group(2), text)


if __name__ == "__main__":
    readme = README.read_text()
    for argument in sys.argv[1:]:
        name, path = argument.split("=", 1)
        readme = paste(readme, name, Path(path).read_text())
    README.write_text(readme)
