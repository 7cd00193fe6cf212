"""Tables for the terminal: markdown for the benchmarks (pasted as is into notes and issues), and for the planner's
answers aligned columns (`aligned`) or, for a table of one column per machine, one section per machine (`sections`),
so a line stays near TERMINAL_WIDTH characters."""
from __future__ import annotations

TERMINAL_WIDTH = 120


def markdown(header: tuple[str, ...], rows: list[tuple]) -> str:
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in row) for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def aligned(header: tuple[str, ...], rows: list[tuple], right: tuple[int, ...] = (), gap: int = 2) -> list[str]:
    """Columns padded to their widest cell, `gap` spaces apart; the columns in `right` (numbers) aligned right."""
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in row) for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return [(" " * gap).join(c.rjust(w) if i in right else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in cells]


def sections(header: tuple[str, ...], rows: list[tuple], keys: int, pivot: int | None = None,
             titles: list[str] | None = None) -> list[str]:
    """A table of `keys` leading key columns and one column per machine, as one aligned section per machine: its
    title (`titles`, else its header), then a line per row with the key columns and that machine's cell. `pivot`: a
    key column whose values become columns of their own (rows that differ only in it share a line)."""
    out = []
    for column in range(keys, len(header)):
        if pivot is None:
            head, lines = header[:keys] + ("",), [r[:keys] + (r[column],) for r in rows]
        else:
            kept = [i for i in range(keys) if i != pivot]
            values = list(dict.fromkeys(r[pivot] for r in rows))
            grouped: dict[tuple, dict] = {}
            for r in rows:
                grouped.setdefault(tuple(r[i] for i in kept), {})[r[pivot]] = r[column]
            head = tuple(header[i] for i in kept) + tuple(f"{header[pivot]} {v}" for v in values)
            lines = [k + tuple(cells.get(v, "") for v in values) for k, cells in grouped.items()]
        title = titles[column - keys] if titles else header[column]
        out += [title] + ["  " + line for line in aligned(head, lines)] + [""]
    return out
