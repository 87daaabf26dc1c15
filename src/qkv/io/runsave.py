"""A save of several files into a folder that is atomic as a whole: a kill at any point leaves
the previous save or the new one, never a mix of the two.

A save (:func:`save_files`) goes in three phases::

    1. write     every file into DIR/.saving/ (fsynced)          killed here: the old save stands,
                                                                   .saving/ is thrown away
    2. commit    DIR/.saving/complete.json, the list of the        one rename: the point where the
                 files, written beside and renamed into place      new save becomes the save
    3. move      each file from .saving/ into DIR, then            killed here: the next reader
                 complete.json and .saving/ removed                moves the rest (roll forward)

Whoever opens the folder next (:func:`finish_save`: ``--resume``, ``qkv sample``, the next save)
first completes a committed save or discards an uncommitted one, so a user never moves files
by hand. A save and a reader exclude each other with an advisory lock on the folder
(``flock``, where the system has it): a reader waits for a save in progress to end instead
of finding it half moved, and never discards the ``.saving/`` another process is writing.
"""
from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

STAGING = ".saving"
COMMIT = "complete.json"


@contextmanager
def folder_lock(folder):
    """Hold an exclusive advisory lock on ``folder`` (no-op where there is no ``flock`` or the
    folder does not exist). A killed holder's lock goes with its process."""
    try:
        import fcntl
        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: go on unlocked, as before
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def _fsync(path: Path, directory: bool = False) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a folder
        pass
    finally:
        os.close(fd)


def _committed(tmp: Path) -> list[str] | None:
    """The file names of a committed save in ``tmp``, or None if it was never committed."""
    try:
        names = json.loads((tmp / COMMIT).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(names, list) and all(isinstance(n, str) and n and "/" not in n and n not in (".", "..")
                                         for n in names)
    return names if ok else None


def _finish(folder: Path) -> None:
    tmp = folder / STAGING
    if not tmp.is_dir():
        return
    names = _committed(tmp)
    for name in names or ():
        if (tmp / name).exists():
            os.replace(tmp / name, folder / name)
    if names is not None:
        _fsync(folder, directory=True)
        os.remove(tmp / COMMIT)  # only once every file is in place: a kill before it moves the rest again
    shutil.rmtree(tmp, ignore_errors=True)


def finish_save(folder) -> None:
    """Complete a save that was committed but not fully moved into ``folder`` (its process was
    killed), or discard one that was not committed; waits for a save in progress. Nothing to
    do (the usual case) costs one ``stat``."""
    folder = Path(folder)
    if not (folder / STAGING).is_dir():
        return
    try:
        with folder_lock(folder):
            _finish(folder)
    except OSError as err:
        from .checkpoint import CheckpointError

        raise CheckpointError(f"{folder}: a save was interrupted and cannot be completed here ({err}); "
                              f"open the folder where it can be written") from None


def save_files(folder, write) -> None:
    """Save into ``folder`` what ``write(staging_folder)`` writes there, atomically as a whole (see
    the module docstring); ``write`` returns the names of the files it wrote."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)   # a new run's folder (the lock needs it to exist)
    with folder_lock(folder):
        _finish(folder)  # a previous save killed after its commit: complete it before starting anew
        tmp = folder / STAGING
        tmp.mkdir()
        names = list(write(tmp))
        for name in names:
            _fsync(tmp / name)
        part = tmp / (COMMIT + ".part")
        with open(part, "w") as f:
            f.write(json.dumps(names))
            f.flush()
            os.fsync(f.fileno())
        _fsync(tmp, directory=True)
        os.replace(part, tmp / COMMIT)  # the commit
        _fsync(tmp, directory=True)
        _finish(folder)


def writable_folder(path, option: str = "--out") -> Path:
    """Make ``path`` a folder (parents too) that qkv can write into, before any work is done, or
    raise ShapeError naming ``option``. Writing is tried (a file made and removed): permission
    bits do not tell, a read-only file system or an ACL can refuse what they allow."""
    import tempfile

    from ..errors import ShapeError

    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".qkv-write-test-", dir=folder)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise ShapeError(f"{option} must be a folder qkv can write to; {str(folder)!r}: {err.strerror}") from None
    return folder
