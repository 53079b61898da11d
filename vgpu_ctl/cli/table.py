"""A table of text cells that prints what rich's `Table` prints (its default heavy-head box), without importing
rich when it can: when every column fits the width at its natural size and each cell is plain text (bare or in
one colour), the lines, with rich's escape codes on a terminal, are written here; otherwise (a cell rich would
wrap, markup it would interpret, a console rich treats specially) rich renders it. Importing and running rich
costs a short command most of its start-up."""

from __future__ import annotations

import os
import re
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.table import Table

_STYLED = re.compile(r"\[([a-z]+)\]([^\[\]]*)\[/\]")  # one style around plain text: "[yellow]UNCONFIRMED[/]"
_SGR = {"bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33", "cyan": "36"}  # rich's codes for them
_BOLD_PAD = "\x1b[1m \x1b[0m"


def _cell(cell: str, ansi: bool) -> tuple[str, str] | None:
    """(text, the cell as printed) of a cell (rich markup) that is plain ASCII, bare or in one style rich prints
    with one code; None for any other cell (markup, emoji codes, wide or control characters, edge spaces), which
    rich must render."""
    styled = _STYLED.fullmatch(cell)
    text = styled.group(2) if styled else cell
    if "[" in text or "]" in text or ":" in text or not (text.isascii() and text.isprintable()) \
            or text != text.strip():
        return None
    if styled is None or not ansi:
        return text, text
    code = _SGR.get(styled.group(1))
    return (text, f"\x1b[{code}m{text}\x1b[0m") if code is not None and text else None


def output_mode() -> str | None:
    """How rich would print to stdout: "plain" (not a terminal: no escape codes), "ansi" (a terminal with
    colours: rich's codes), or None for a console it treats otherwise (a dumb terminal, NO_COLOR, not UTF-8,
    Windows, Jupyter), which rich must print to. Rich's own test (`Console.is_terminal`), for stdout."""
    env = os.environ
    if sys.platform == "win32" or "IPython" in sys.modules \
            or not (getattr(sys.stdout, "encoding", None) or "utf-8").lower().startswith("utf"):
        return None
    compatible, force = env.get("TTY_COMPATIBLE", ""), env.get("FORCE_COLOR")
    if compatible in ("0", "1"):
        terminal = compatible == "1"
    elif force is not None:
        terminal = force != ""
    else:
        try:
            terminal = sys.stdout.isatty()
        except ValueError:  # closed: not a terminal, as rich decides
            terminal = False
    if not terminal:
        return "plain"
    if env.get("NO_COLOR") or env.get("TERM", "").lower() in ("dumb", "unknown"):
        return None
    return "ansi"


def output_width() -> int:
    """The width rich gives a console on stdout that is not a terminal: $COLUMNS, else the size of the
    terminal on stdin, stdout or stderr, else 80."""
    columns = os.environ.get("COLUMNS")
    if columns is not None and columns.isdigit():
        return int(columns)
    for fd in (0, 1, 2):
        try:
            return os.get_terminal_size(fd).columns or 80
        except (AttributeError, ValueError, OSError):
            continue
    return 80


class PlainTable:
    """A table of header and rows of text cells (rich markup, as rich's `Table` takes them)."""

    def __init__(self, *headers: str) -> None:
        self.headers = headers
        self.rows: list[tuple[str, ...]] = []

    def add_row(self, *cells: str) -> None:
        """Add a row, one cell per column."""
        self.rows.append(cells)

    def render(self, width: int, ansi: bool = False) -> str | None:
        """The table's lines as rich prints them on a console `width` wide (`ansi`: a terminal, with rich's
        escape codes: the header bold, a styled cell in its colour), or None when rich must render it (a cell
        that is not plain text, or columns wider than the console together)."""
        if any(len(row) != len(self.headers) for row in self.rows) \
                or (ansi and any(_STYLED.fullmatch(h) for h in self.headers)):
            return None
        cells = []
        for row in (self.headers, *self.rows):
            got = [_cell(c, ansi) for c in row]
            if None in got:
                return None
            cells.append([c for c in got if c is not None])
        widths = [max(len(r[i][0]) for r in cells) for i in range(len(self.headers))]
        if sum(w + 2 for w in widths) + len(widths) + 1 > width:
            return None

        def rule(left: str, fill: str, mid: str, right: str) -> str:
            return left + mid.join(fill * (w + 2) for w in widths) + right

        def line(row: list[tuple[str, str]]) -> str:
            return "│" + "│".join(f" {shown}{' ' * (w - len(text))} "
                                  for (text, shown), w in zip(row, widths, strict=True)) + "│"

        def head(row: list[tuple[str, str]]) -> str:
            if not ansi:
                return "┃" + "┃".join(f" {text.ljust(w)} " for (text, _), w in zip(row, widths, strict=True)) + "┃"
            return "┃" + "┃".join(f"{_BOLD_PAD}\x1b[1m{text.ljust(w)}\x1b[0m{_BOLD_PAD}"
                                  for (text, _), w in zip(row, widths, strict=True)) + "┃"

        out = [rule("┏", "━", "┳", "┓"), head(cells[0]), rule("┡", "━", "╇", "┩"), *(line(r) for r in cells[1:]),
               rule("└", "─", "┴", "┘")]
        return "\n".join(out) + "\n"

    def to_rich(self) -> Table:
        """The same table as rich's `Table`."""
        from rich.table import Table

        table = Table(*self.headers)
        for row in self.rows:
            table.add_row(*row)
        return table
