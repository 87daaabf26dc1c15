"""Where a conversion writes: never over a file or folder qkv did not make there, and atomically.

A target is free when nothing is there yet, or (a folder) when it is empty. Anything else is a
:class:`CheckpointError` naming what is there, unless the caller says ``force``: then the files
qkv writes replace theirs, one rename each, and nothing else in the folder is touched.

A new folder is written whole into a hidden sibling (``.NAME.part-XXXX``) and renamed into
place at the end, so a kill leaves either no folder or the whole one; a file is written beside
itself (``NAME.part``) and renamed over, so a kill leaves the old file or the new one.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .checkpoint import CheckpointError

__all__ = ["free_file", "free_folder", "publish_folder", "write_atomic"]


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def free_folder(dst, force: bool = False) -> Path:
    """``dst`` as a folder qkv may write into: absent, empty, or (``force``) any folder."""
    dst = Path(dst)
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"{str(dst)!r} is a file, not a folder; name a new folder")
    held = sorted(p.name for p in dst.iterdir()) if dst.is_dir() else []
    if held and not force:
        raise CheckpointError(f"{str(dst)!r} already holds {_shown(held)}, which qkv convert did not write there; "
                              f"name a new or empty folder (or pass --force to replace the files it writes)")
    return dst


def free_file(dst, force: bool = False, same: bytes | None = None) -> Path:
    """``dst`` as a file qkv may write: absent, holding exactly ``same`` already, or (``force``) any file."""
    dst = Path(dst)
    if dst.is_dir():
        raise CheckpointError(f"{str(dst)!r} is a folder, not a file name")
    if dst.exists() and not force and (same is None or dst.read_bytes() != same):
        raise CheckpointError(f"{str(dst)!r} already exists and qkv convert does not replace a file it did not "
                              f"write; name another file (or pass --force)")
    return dst


def write_atomic(path, data: bytes) -> None:
    """``data`` into ``path`` whole: written beside it, synced, then renamed over it."""
    path = Path(path)
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def publish_folder(dst, write) -> None:
    """Call ``write(folder)`` on a hidden sibling of ``dst``, then put its files in place: the
    folder renamed to ``dst`` where none is there (or an empty one), else each file renamed into
    ``dst`` (a folder :func:`free_folder` let through with ``force``)."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name[:100]}.part-", dir=dst.parent))
    try:
        write(tmp)
        if dst.is_dir() and not any(dst.iterdir()):
            dst.rmdir()
        if not dst.exists():
            os.rename(tmp, dst)
            return
        for item in sorted(tmp.iterdir()):
            os.replace(item, dst / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
