"""Optional dependencies, imported where they are needed, with an error that names the extra.

``import qkv`` costs NumPy (and threadpoolctl) only. Anything else — matplotlib, rich,
safetensors, tokenizers, torch, mpi4py — is imported inside the function that needs it,
through :func:`require`, so a missing package says which ``pip install -e '.[extra]'`` line
brings it instead of a bare ``ModuleNotFoundError``.
"""
from __future__ import annotations

import importlib


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message says which extra brings it."""


def require(module: str, extra: str):
    """Import ``module`` or raise :class:`MissingExtra` naming ``pip install -e '.[extra]'``.

    >>> require("math", "viz").sqrt(4.0)
    2.0
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtra(
            f"this needs the optional dependency '{module.split('.')[0]}' ({err}); "
            f"install it with: pip install -e '.[{extra}]' (in qkv's folder: qkv is installed from its checkout)"
        ) from None


def figure(**kwargs):
    """A new matplotlib ``Figure`` (extra ``viz``), drawn without pyplot.

    A ``Figure`` made this way needs no GUI backend and changes no global matplotlib
    state, so library code can draw and ``fig.savefig(path)`` from a script, a server
    thread or a notebook alike.
    """
    require("matplotlib", "viz")
    from matplotlib.figure import Figure

    return Figure(**kwargs)
