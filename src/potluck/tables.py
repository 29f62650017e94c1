"""Compact rich tables for the CLI's reports: no vertical rules and one space between
columns, so they read in an 80-column terminal."""

from __future__ import annotations

from collections.abc import Iterable

from rich import box
from rich.table import Table


def compact_table(title: str, columns: Iterable[str], left: Iterable[str] = ()) -> Table:
    """A table titled ``title``; ``left`` columns are left-aligned and never wrap, the
    others (numbers) are right-aligned."""
    left = set(left)
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  show_edge=False, padding=(0, 1, 0, 0))
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right",
                         no_wrap=column in left)
    return table
