"""What every subcommand shares: output paths checked before the work (progress is in ``progress``)."""
from __future__ import annotations

import os
import tempfile
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
    """Make ``path`` a folder (parents too) that qkv can write into, before any work is done, or
    raise UsageError naming ``option``. Writing is tried (a file made and removed): permission
    bits do not tell, a read-only file system or an ACL can refuse what they allow."""
    folder = named_path(path, option)
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
