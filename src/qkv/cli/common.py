"""What every subcommand shares: output paths checked before the work, and progress bars."""
from __future__ import annotations

import numbers
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ..extras import require


class UsageError(Exception):
    """A command-line argument the command cannot use (a path it cannot write, say): exit 2."""


def out_folder(path, option: str = "--out") -> Path:
    """Make ``path`` a folder (parents too) that qkv can write into, before any work is done, or
    raise UsageError naming ``option``. Writing is tried (a file made and removed): permission
    bits do not tell, a read-only file system or an ACL can refuse what they allow."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".qkv-write-test-", dir=folder)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise UsageError(f"{option} must be a folder qkv can write to; {str(folder)!r}: {err.strerror}") from None
    return folder


def out_file(path, option: str, suffixes: tuple[str, ...] = ()) -> Path:
    """``path`` as a file qkv can write: one of ``suffixes`` (if given), in an existing folder."""
    file = Path(path)
    if suffixes and file.suffix.lower() not in suffixes:
        raise UsageError(f"{option} must end in {' or '.join(suffixes)}; got {str(file)!r}")
    if file.is_dir():
        raise UsageError(f"{option} must be a file name; {str(file)!r} is a folder")
    if not file.parent.is_dir():
        raise UsageError(f"{option} must be in an existing folder; {str(file.parent)!r} is not one")
    return file


@contextmanager
def progress_bar(label: str, total: int, *fields: str, transient: bool = False, stderr: bool = False,
                 remaining: bool = False, completed: int = 0):
    """A rich progress bar; yields ``update(advance=1, **fields)``. ``fields`` are shown as
    ``name value`` after the count (floats to 4 decimals); ``update(description=...)``
    replaces ``label``. ``transient`` removes the bar when done; ``stderr`` draws it there,
    keeping standard output for the command's results; ``remaining`` adds the estimated
    time left; ``completed`` is where the count starts (a resumed run)."""
    require("rich", "cli")
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = [TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}")]
    columns += [TextColumn(f"{f} {{task.fields[{f}]}}") for f in fields]
    console = Console(stderr=True) if stderr else None

    def shown(value):  # a number to 4 decimals; before the first one, a dash (not "nan")
        return f"{value:.4f}" if isinstance(value, numbers.Real) else str(value)

    timers = [TimeElapsedColumn()] + ([TextColumn("left"), TimeRemainingColumn()] if remaining else [])
    with Progress(*columns, *timers, transient=transient, console=console) as bar:
        task = bar.add_task(label, total=total, completed=completed, **{f: "—" for f in fields})
        yield lambda advance=1, **values: bar.update(
            task, advance=advance, **{k: (v if k == "description" else shown(v)) for k, v in values.items()})
