"""Progress for every long command (``train gpt``, ``train lookup``, ``bench``, ``experiment``), on stderr.

Where stderr is a terminal: a rich bar with the count, the fields, then ``0:00:27 elapsed,
0:00:05 left`` (each time labelled). Elsewhere (a log file, a pipe, CI, ``nohup``): a plain line at the start,
every ``QKV_PROGRESS_INTERVAL`` seconds (default 5) and at the end, such as::

    gpt: 120/2000, 6%, 1m12s elapsed, ~18m48s left, loss 2.4512, val —, tok/s 5,130

The time left is the steps still to do at the mean rate of the steps done in this process
(a resumed run counts from where it resumed), compiling left out: while the fast extra's
kernels compile (the first run on a CPU, once per machine and qkv version) the line says
``compiling (first run on this CPU) 41s`` in place of the time left, and the estimate starts
from the steps' own pace once it is done. The lines come from a background thread, so
a step that takes a minute still shows a line every few seconds. Standard output stays for
the command's results in both cases.
"""
from __future__ import annotations

import numbers
import os
import sys
import threading
import time
from contextlib import contextmanager

from ..extras import MissingExtra, require
from .common import UsageError

INTERVAL_ENV = "QKV_PROGRESS_INTERVAL"
DEFAULT_INTERVAL = 5.0


def on_terminal() -> bool:
    """Whether stderr is a terminal (a bar is drawn) rather than a file or a pipe (lines are written)."""
    return sys.stderr is not None and sys.stderr.isatty()


def check_progress(switch: str | None = "--no-progress"):
    """What showing progress needs, checked: rich where a bar will be drawn (stderr is a
    terminal; missing, a MissingExtra that names the extra and, if the command has one, the
    ``switch`` that needs no rich), else a valid ``QKV_PROGRESS_INTERVAL``. Commands call this
    before their work, so a missing rich is said at once, not after minutes of set-up."""
    if not on_terminal():
        interval()
        return None
    try:
        return require("rich", "cli")
    except MissingExtra as err:
        if switch is None:
            raise
        raise MissingExtra(f"{err}; or run without the progress bar: {switch} needs no rich") from None


def interval() -> float:
    """Seconds between two plain progress lines: ``QKV_PROGRESS_INTERVAL`` (a number > 0), default 5."""
    raw = os.environ.get(INTERVAL_ENV)
    if raw is None or raw == "":
        return DEFAULT_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise UsageError(f"{INTERVAL_ENV} must be a number of seconds > 0; got {raw!r}")
    return value


COMPILING = "compiling (first run on this CPU)"


def compile_state() -> tuple[float | None, float]:
    """``(seconds the compile in progress has run or None, seconds compiled in all so far)``."""
    from .. import jit_cache

    return jit_cache.compiling(), jit_cache.compile_total()


def left(done: int, first: int, total: int, elapsed: float, compiled: float) -> float | None:
    """Seconds left at the mean pace of this process's steps, the ``compiled`` seconds left out;
    None before a step is done (no pace yet)."""
    steps, spent = done - first, elapsed - compiled
    if steps <= 0 or spent <= 0:
        return None
    return (total - done) * spent / steps


def duration(seconds: float) -> str:
    """``45s``, ``1m12s``, ``2h05m``: a time span as a person reads it."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def shown(value) -> str:
    """A field's value: a number to 4 decimals, anything else (a dash before the first one) as is."""
    return f"{value:.4f}" if isinstance(value, numbers.Real) and not isinstance(value, bool) else str(value)


@contextmanager
def progress_bar(label: str, total: int, *fields: str, transient: bool = False, completed: int = 0,
                 switch: str | None = "--no-progress"):
    """Show progress of ``total`` steps on stderr; yields ``update(advance=1, description=None, **fields)``.

    ``fields`` are shown as ``name value`` after the count (floats to 4 decimals);
    ``description`` replaces ``label``; ``transient`` removes the bar when done (a terminal
    only); ``completed`` is where the count starts (a resumed run). A bar with the time left
    where stderr is a terminal (rich: missing, the error names ``switch``), plain lines
    elsewhere (see the module docstring)."""
    if on_terminal():
        with _bar(label, total, fields, transient, completed, switch) as update:
            yield update
        return
    lines = Lines(label, total, fields, completed)
    with lines.running(interval()):
        yield lines.update


@contextmanager
def _bar(label, total, fields, transient, completed, switch):
    check_progress(switch)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}")]
    columns += [TextColumn(f"{f} {{task.fields[{f}]}}") for f in fields]
    columns += [TimeElapsedColumn(), TextColumn("elapsed,"), _left_column(completed)]
    with Progress(*columns, transient=transient, console=Console(stderr=True)) as bar:
        task = bar.add_task(label, total=total, completed=completed, **{f: "—" for f in fields})
        yield lambda advance=1, **values: bar.update(
            task, advance=advance, **{k: (v if k == "description" else shown(v)) for k, v in values.items()})


def _left_column(first: int):
    """The bar's last column: the time left (compiling left out), or that kernels are compiling."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    before = compile_state()[1]   # compiling done before this bar started is not its steps' time

    class Left(ProgressColumn):
        def render(self, task):
            now, compiled = compile_state()
            compiled -= before
            if now is not None:
                return Text(f"{COMPILING} {duration(compiled)}", style="yellow")
            seconds = left(int(task.completed), first, int(task.total or 0), task.elapsed or 0.0, compiled)
            if seconds is None:
                return Text("-:--:-- left", style="cyan")
            s = int(round(seconds))
            return Text(f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d} left", style="cyan")   # rich's clock

    return Left()


class Lines:
    """The plain progress of a stderr that is not a terminal: the count and its fields as one
    line, written by :meth:`running` at the start, every ``seconds`` and at the end."""

    def __init__(self, label: str, total: int, fields=(), completed: int = 0, clock=time.monotonic):
        self.description, self.total, self.done, self.first = label, total, completed, completed
        self.values = {f: "—" for f in fields}
        self.clock, self.t0 = clock, clock()
        self.compiled0 = compile_state()[1]   # compiling done before this count started is not its time
        self.lock = threading.Lock()

    def update(self, advance: int = 1, description: str | None = None, **values) -> None:
        with self.lock:
            self.done += advance
            if description is not None:
                self.description = description
            self.values.update({k: shown(v) for k, v in values.items()})

    def line(self) -> str:
        """``label: done/total, P%, E elapsed, ~L left, field value, ...`` (no ``left`` before the
        first step of this process: no rate to estimate it from; ``compiling (first run on this
        CPU) S`` in its place while kernels compile; ``done`` once the count is full)."""
        now, compiled = compile_state()
        with self.lock:
            elapsed, done, total = self.clock() - self.t0, self.done, self.total
            parts = [f"{self.description}: {done}/{total}", f"{100 * done / total:.0f}%" if total else "",
                     f"{duration(elapsed)} elapsed"]
            seconds = left(done, self.first, total, elapsed, compiled - self.compiled0)
            if done >= total:
                parts.append("done")
            elif now is not None:   # the compiling of this count so far, the compile in progress included
                parts.append(f"{COMPILING} {duration(compiled - self.compiled0)}")
            elif seconds is not None:
                parts.append(f"~{duration(seconds)} left")
            parts += [f"{k} {v}" for k, v in self.values.items()]
        return ", ".join(p for p in parts if p)

    @contextmanager
    def running(self, seconds: float):
        """Write :meth:`line` to stderr now, every ``seconds`` from a daemon thread, and at a
        normal end (after an error the error speaks)."""
        stop = threading.Event()

        def write():
            print(self.line(), file=sys.stderr, flush=True)

        def loop():
            while not stop.wait(seconds):
                write()
        write()
        ticker = threading.Thread(target=loop, name="qkv-progress", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
        write()
