"""Console output of the CLI and the harness.

On a terminal: rich (colours, tables, progress bars). Off one (a pipe, a CI log): whole plain
lines, never wrapped or cut at 80 columns. A reader that goes away (``python -m codegen audit |
head -1``) is not an error: the ``BrokenPipeError`` reaches ``codegen.cli.main``, which exits 0.
"""
from __future__ import annotations

from rich.console import Console

WIDE = 1 << 16   # off a terminal: as wide as any line is


class _Console(Console):
    def on_broken_pipe(self) -> None:
        raise BrokenPipeError   # rich would exit 1 here; codegen.cli.main exits 0


def console(*, stderr: bool = False, markup: bool = True) -> Console:
    """A console for stdout (or stderr). ``markup=False``: text is printed verbatim (compiler logs,
    paths), styles come only from ``rich.text.Text``."""
    c = _Console(highlight=False, markup=markup, stderr=stderr)
    if c.is_terminal:
        return c
    return _Console(highlight=False, markup=markup, stderr=stderr, width=WIDE, soft_wrap=True)
