"""Compact rich tables for the CLI's reports: no vertical rules and one space between
columns, so they read in an 80-column terminal; where even that is too narrow, a report
leaves whole columns out (:func:`fitting_columns`) and says which, rather than cutting
every cell short."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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


COLUMN_GAP = 2  # characters between two columns: the box's blank rule and one of padding


def fitting_columns(columns: Sequence[str], rows: Sequence[Sequence[str]], width: int,
                    drop_order: Sequence[str]) -> list[str]:
    """The columns of a :func:`compact_table` of ``rows`` that fit in ``width`` characters,
    leaving out those of ``drop_order`` first to last until the rest fit (each column as
    wide as its widest cell or heading, :data:`COLUMN_GAP` between)."""
    widths = {name: max([len(name), *(len(row[i]) for row in rows)])
              for i, name in enumerate(columns)}
    kept = list(columns)
    for name in drop_order:
        if sum(widths[c] for c in kept) + COLUMN_GAP * (len(kept) - 1) <= width:
            break
        kept.remove(name)
    return kept
