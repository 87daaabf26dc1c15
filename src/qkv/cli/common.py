"""What every subcommand shares: output paths checked before the work (progress is in ``progress``)."""
from __future__ import annotations

from pathlib import Path


class UsageError(Exception):
    """A command-line argument the command cannot use (a path it cannot write, say): exit 2."""


def named_path(path, option: str) -> Path:
    """``path`` as a Path, refusing the empty name: ``Path('')`` is the current folder, which
    nobody names by typing ``--out ''`` (an unset shell variable does that)."""
    if not str(path).strip():
        raise UsageError(f"{option} must name a folder; got {str(path)!r} (for the current folder, say '.')")
    return Path(path)


def out_folder(path, option: str = "--out") -> Path:
    """Make ``path`` a folder qkv can write into, before any work is done, or raise a ShapeError
    naming ``option`` (:func:`qkv.io.runsave.writable_folder`; the empty name refused first)."""
    from ..io.runsave import writable_folder

    return writable_folder(named_path(path, option), option)


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
