"""A titled table of text cells, drawn as text or Markdown (:mod:`report` and the suites' own tables)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Table:
    """A titled table of text cells; the first ``left`` columns are left-aligned, the rest
    right-aligned. ``notes`` are lines that belong under it."""
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    left: int = 0
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        cells = [self.columns] + self.rows
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]
        lines = [self.title]
        for r in cells:
            lines.append("  ".join(c.ljust(w) if i < self.left else c.rjust(w)
                                   for i, (c, w) in enumerate(zip(r, widths))))
        return "\n".join(lines + self.notes)

    def markdown(self) -> str:
        """The rows as a Markdown table (left columns ``---``, the others ``---:``), for a README."""
        lines = ["| " + " | ".join(self.columns) + " |",
                 "|" + "|".join("---" if i < self.left else "---:" for i in range(len(self.columns))) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines)


def fmt(x, spec):
    return "—" if x is None else format(x, spec)
