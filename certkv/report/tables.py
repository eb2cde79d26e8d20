"""Console tables and lines that never cut a value, in a terminal or in a log.

rich shortens a cell that does not fit with ``…`` by default, and without a TTY (a CI log, ``| cat``)
the console is 80 columns wide, so a wide table printed there turns bounds into ``0.0…``: a number
a reader cannot use and may misread. Every table certkv prints is built here instead, with three
rules:

* every column folds (``overflow="fold"``) and none is ``no_wrap``: a cell that cannot fit wraps
  onto the next line, whole, instead of being cut or ellipsised (rich silently crops a ``no_wrap``
  cell that does not fit, whatever its overflow);
* the values are pre-formatted short strings (:mod:`certkv.report.text`), and the narrow tables
  are laid out to fit 80 columns, so in practice nothing needs folding;
* a table meant to be wide (``certkv certify --wide``) is printed at its natural width
  (:func:`print_table` with ``natural=True``), never squeezed into the terminal's.

Cells go in through :func:`add_row` and prose through :func:`say`: both print names literally
(rich markup and emoji codes are not parsed; a policy called ``[x]`` stays ``[x]``), and prose
wraps at spaces only.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

#: How a column's cells are justified (rich's own names).
Justify = Literal["default", "left", "center", "right", "full"]


def narrow_table(columns: Iterable[tuple[str, Justify]]) -> Table:
    """A compact rich table: header underlined, one space between columns, every column folding.

    `columns` is a sequence of ``(header, justify)``. No rich title: a centred title wraps into
    a ragged block at 80 columns, so :func:`print_table` prints it as a paragraph above the table.
    Add rows with :func:`add_row`.
    """
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False, header_style="bold")
    for header, justify in columns:
        table.add_column(header, justify=justify, overflow="fold")
    return table


def add_row(table: Table, *cells: str, style: str | None = None) -> None:
    """Add a row of plain-text cells: rich would read ``[x]`` in a name as markup and ``:x:`` as
    an emoji code, and a loss table from another system may name its policies anything."""
    from rich.text import Text

    table.add_row(*(Text(str(c)) for c in cells), style=style)


def natural_width(console: Console, table: Table) -> int:
    """The width `table` takes when nothing in it wraps."""
    from rich.measure import Measurement

    return Measurement.get(console, console.options.update_width(1 << 15), table).maximum


def print_table(console: Console, table: Table, title: str | None = None, natural: bool = False) -> None:
    """Print `title` (a paragraph, see :func:`say`) and `table` on `console`.

    Parameters
    ----------
    console : rich.console.Console
    table : rich.table.Table
        Built by :func:`narrow_table`.
    title : str, optional
        Printed above the table, wrapped at spaces.
    natural : bool
        Print the table at its own width even when the console is narrower (``--wide`` output
        is for wide terminals, pagers and files; folding 216 rows of 12 columns into 80 columns
        helps nobody). The console's width is restored afterwards.
    """
    if title:
        say(console, title)
    if not natural:
        console.print(table)
        return
    saved = console.width
    console.width = max(saved, natural_width(console, table))
    try:
        console.print(table)
    finally:
        console.width = saved


def say(console: Console, text: str, label: str | None = None, style: str | None = None) -> None:
    """One paragraph, wrapped at spaces to the console's width; `label` (e.g. ``Chosen``) is shown
    in `style` before it. rich markup in `text` is printed literally: names come from contracts
    and loss tables."""
    from rich.text import Text

    body = Text()
    if label:
        body.append(label, style=style)
        body.append(": ")
    body.append(text)
    console.print(body, highlight=False, overflow="fold")


def say_path(console: Console, label: str, path: str | Path) -> None:
    """``label path`` with the path never broken across lines, so it can be copied from a log
    (a path longer than the console is the one thing printed past its width)."""
    from rich.text import Text

    console.print(Text(f"{label} {path}"), soft_wrap=True, highlight=False)


__all__ = ["add_row", "narrow_table", "natural_width", "print_table", "say", "say_path"]
