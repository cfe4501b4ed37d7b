"""Fit ``shmrdv bench``'s markdown into a terminal's width: no line over 100 columns.

Every mode's report goes through ``fit_markdown`` on its way to stdout. A prose line
longer than the width is wrapped (a list item's continuation is indented under its
text; markdown joins the lines again). A table with a row longer than the width is cut
into several tables of fewer columns, each repeating the first column (the method or
the path), so that no cell is cut. Headings, code blocks and short lines stay as they are.
Pure functions over text: nothing here measures or prints.
"""

from __future__ import annotations

import re
import textwrap

__all__ = ["WIDTH", "fit_markdown", "split_table", "wrap_line"]

WIDTH = 100

_ITEM = re.compile(r"^(\s*(?:[*-]|\d+\.)\s+)")


def wrap_line(line: str, width: int = WIDTH) -> list[str]:
    """``line`` as lines of at most ``width`` characters (a word longer than that stays whole)."""
    if len(line) <= width:
        return [line]
    item = _ITEM.match(line)
    lead = re.match(r"^\s*", line)
    first = item.group(1) if item else (lead.group(0) if lead else "")
    rest = " " * len(first)
    return textwrap.wrap(
        line[len(first) :],
        width=width,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [line]


def _cells(row: str) -> list[str]:
    inner = row.strip()
    if inner.startswith("|"):
        inner = inner[1:]
    if inner.endswith("|"):
        inner = inner[:-1]
    return [c.strip() for c in inner.split(" | ")]


def _render(rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out.extend("| " + " | ".join(r) + " |" for r in rows[1:])
    return out


def split_table(lines: list[str], width: int = WIDTH) -> list[str]:
    """A markdown table (header, ``|---|`` rule, rows) as one or more tables of at most
    ``width`` characters per line where the cells allow it; each repeats column 0."""
    if all(len(line) <= width for line in lines) or len(lines) < 2:
        return lines
    rows = [_cells(line) for i, line in enumerate(lines) if i != 1]
    ncols = max(len(r) for r in rows)
    rows = [r + [""] * (ncols - len(r)) for r in rows]
    colw = [max(len(r[c]) for r in rows) for c in range(ncols)]
    groups: list[list[int]] = []
    current: list[int] = []
    used = 4 + colw[0]  # "| " + first + " |"
    for c in range(1, ncols):
        extra = colw[c] + 3  # " " + cell + " |"
        if current and used + extra > width:
            groups.append(current)
            current, used = [], 4 + colw[0]
        current.append(c)
        used += extra
    if current:
        groups.append(current)
    out: list[str] = []
    for g, cols in enumerate(groups):
        if g:
            out.append("")
        out += _render([[r[0], *(r[c] for c in cols)] for r in rows])
    return out


def fit_markdown(text: str, width: int = WIDTH) -> str:
    """``text`` with its long prose lines wrapped and its wide tables split (see above)."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    fenced = False
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            fenced = not fenced
            out.append(line)
            i += 1
        elif fenced or line.startswith("#"):
            out.append(line)
            i += 1
        elif line.startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            out += split_table(lines[i:j], width)
            i = j
        else:
            out += wrap_line(line, width)
            i += 1
    return "\n".join(out)
