"""Writing safetensors files with the permissions every other file of a run gets.

``safetensors.numpy.save_file`` writes through a private temporary file, so its files come
out ``0600`` whatever the user's umask, while ``config.json``, ``log.json`` and ``loss.png``
beside them come out ``0666 & ~umask`` (``0644`` under the usual ``022``). :func:`write_tensors`
writes through safetensors and then gives the file the mode :func:`open` would have given it.
"""
from __future__ import annotations

import os
from pathlib import Path


def umask() -> int:
    """The process's umask: read from ``/proc/self/status`` where Linux says it (nothing
    changed, no race with other threads), else set and restored at once (``os.umask``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_tensors(tensors: dict, path, metadata: dict | None = None) -> None:
    """``tensors`` (name -> NumPy array) to the safetensors file ``path`` (``metadata``: str -> str),
    with mode ``0o666 & ~umask`` as a file made by ``open(path, "w")`` (extra ``models``)."""
    from ..extras import require

    path = Path(path)
    require("safetensors.numpy", "models").save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~umask())
