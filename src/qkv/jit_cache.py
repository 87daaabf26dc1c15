"""Where the ``fast`` extra's compiled kernels are kept: one folder per machine, qkv version, CPU and source.

numba compiles a ``cache=True`` function at its first call for a signature and keeps the
machine code on disk. Its own cache sits in ``__pycache__`` beside each module and is
stamped with that file's modification time, so every checkout or virtual environment
compiles anew (about two CPU-minutes for a training run), and a change in a helper that a
kernel *inlines* from another file (:mod:`qkv.kernels.rows.compiled` into
:mod:`qkv.kernels.rows.fused`) leaves the stale kernel in place. Here instead every module
of :data:`COMPILED` is cached under one folder::

    $QKV_CACHE_DIR/numba/<version>-<cpu>-<build>-<source>/<module>/
    (QKV_CACHE_DIR unset: $XDG_CACHE_HOME/qkv, else ~/.cache/qkv)

- ``version``: qkv's; ``cpu``: the CPU numba compiles for (``NUMBA_CPU_NAME`` or the host's);
- ``build``: a hash of that CPU's feature string (``NUMBA_CPU_FEATURES`` or the host's),
  numba's version and Python's (two environments with different numba never overwrite
  each other's index);
- ``source``: a hash of the bytes of every file of :data:`COMPILED`, so that any change to
  compiled or inlined code gives a fresh folder.

Each file's cache is stamped with ``source`` instead of its path and modification time, so
every checkout and environment with the same sources shares it. A user's own
``NUMBA_CACHE_DIR`` wins: numba's locator then places everything as numba documents it
(CI's AVX2 leg sets it to a fresh temporary folder). Two processes compiling the same
kernel at once are safe: numba writes each index and data file to a temporary name and
renames it into place; the last writer's index wins, and a kernel it drops is compiled
again later, never loaded wrong.

:func:`install` (called by :func:`qkv.jit.load` before it imports a compiled module) puts
the locator in front of numba's and a listener on numba's compile events that prints one
line on stderr at the first compile a process makes (a cache hit prints nothing).
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from pathlib import Path

# Every module whose numba code is compiled or inlined into a compiled kernel; the source hash covers them all.
COMPILED = ("qkv.kernels.flash.compiled", "qkv.kernels.blas_compiled", "qkv.kernels.rows.compiled",
            "qkv.kernels.rows.fused", "qkv.recurrent.decay.compiled", "qkv.recurrent.delta.compiled",
            "qkv.kernels.rope_compiled", "qkv.recurrent.scan.compiled", "qkv.models.compiled", "qkv.nn.fused",
            "qkv.recurrent.decay.channel_compiled", "qkv.recurrent.generalized_delta.compiled",
            "qkv.kernels.products_compiled", "qkv.kernels.flash.task_compiled",
            "qkv.kernels.flash.precise_compiled", "qkv.recurrent.crossing_compiled",
            "qkv.recurrent.delta.channels_compiled", "qkv.kernels.conv_compiled",
            "qkv.recurrent.decay.intra_compiled")
# What compiling costs, measured (docs/bench/cold.json, `qkv bench --suite cold`; a test holds
# these to that record): most kernels under a second of CPU, the tiled forward's task loop
# (kernels/flash/task_compiled.py, the exponential passes it calls compiled into it again) about
# 3 s, the row kernel's forward and backward (kernels/rows/fused.py) seconds each, once for each
# softcap/dropout case a job runs.
ROW_KERNEL_CPU_S = (11, 14)
COMPILE_ABOUT = "a second of CPU or a few a kernel"
ROW_KERNEL_ABOUT = (f"the row kernel's forward and backward about {ROW_KERNEL_CPU_S[0]} and {ROW_KERNEL_CPU_S[1]} s "
                    "of CPU for each softcap/dropout case a job runs")
ROW_KERNEL_MODULES = ("qkv.kernels.rows.fused", "qkv.kernels.rows.compiled")
PACKAGE = Path(__file__).resolve().parent

_lock = threading.Lock()
_installed: list[Path | None] = []
_notices: list = []   # the process's compile listener (its ``seconds``: what each kernel took)


def root() -> Path:
    """qkv's cache folder, read from the environment now: ``QKV_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/qkv``, else ``~/.cache/qkv`` (the corpus is kept there too)."""
    env = os.environ
    return Path(env.get("QKV_CACHE_DIR") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "qkv")).expanduser()


def source_files() -> dict[str, Path]:
    """Module name -> its file, for every module of :data:`COMPILED`."""
    return {name: PACKAGE.joinpath(*name.split(".")[1:]).with_suffix(".py") for name in COMPILED}


def source_hash(files: dict[str, Path] | None = None) -> str:
    """12 hex digits of SHA-256 over the names and bytes of ``files`` (default :func:`source_files`)."""
    h = hashlib.sha256()
    for name, path in sorted((files or source_files()).items()):
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def target_cpu() -> tuple[str, str]:
    """``(name, features)`` of the CPU numba compiles for: ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES``
    where set (numba's config), else the host's as llvmlite reports them."""
    from llvmlite import binding as ll
    from numba.core import config

    name = config.CPU_NAME if config.CPU_NAME is not None else ll.get_host_cpu_name()
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else ll.get_host_cpu_features().flatten()
    return name, features


def key(version: str, cpu: str, features: str, source: str, numba_version: str, python: str) -> str:
    """The cache folder's name: ``<version>-<cpu>-<build>-<source>``, ``build`` 8 hex digits of a
    hash of ``features``, ``numba_version`` and ``python``; characters outside ``[\\w.+-]`` become ``_``."""
    build = hashlib.sha256(f"{features}|{numba_version}|{python}".encode()).hexdigest()[:8]
    name = f"{version}-{cpu or 'cpu'}-{build}-{source}"
    return "".join(c if c.isalnum() or c in "._+-" else "_" for c in name)


def folder() -> Path:
    """This process's kernel cache folder, ``root()/numba/key(...)`` (see the module docstring)."""
    import numba

    from . import __version__

    cpu, features = target_cpu()
    return root() / "numba" / key(__version__, cpu, features, source_hash(), numba.__version__,
                                  f"{sys.version_info[0]}.{sys.version_info[1]}")


def install() -> Path | None:
    """Put qkv's cache locator in front of numba's and the compile notice on numba's compile
    events, once per process; returns the cache folder, or None where ``NUMBA_CACHE_DIR``
    is set (numba's own locator is then used as it documents)."""
    with _lock:
        if not _installed:
            from .threads import prefer_tbb
            prefer_tbb()   # numba's fork-safe TBB layer where the fast extra installed TBB (before its threads start)
            _installed.append(_install())
    return _installed[0]


def compile_seconds() -> dict[str, float]:
    """Seconds this process spent compiling each function of :data:`COMPILED` (its outermost
    compiles, wall time; empty where everything came from the cache or nothing was installed)."""
    return dict(_notices[0].seconds) if _notices else {}


def compiling() -> float | None:
    """Seconds the compile in progress has run (numba compiling a kernel now: a cache miss, the first
    run on this CPU), or None. Read from any thread: a progress line says so while it lasts."""
    notice = _notices[0] if _notices else None
    return None if notice is None or notice.depth <= 0 else time.perf_counter() - notice.started


def compile_total() -> float:
    """Seconds this process has spent compiling so far (the compile in progress included): what a
    time-left estimate leaves out, so it starts from the steps' own pace."""
    notice = _notices[0] if _notices else None
    if notice is None:
        return 0.0
    return notice.total + (time.perf_counter() - notice.started if notice.depth > 0 else 0.0)


def _install() -> Path | None:
    from numba.core import caching, config, event

    user_dir = bool(config.CACHE_DIR)
    where = config.CACHE_DIR if user_dir else folder()
    if not user_dir:
        files = {os.path.realpath(path): name for name, path in source_files().items()}
        impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)  # renamed in numba 0.59
        if impl is None or not hasattr(caching, "_CacheLocator"):  # a numba without them: its own cache, as before
            user_dir, where = True, "numba's own cache (__pycache__ beside each module)"
        else:
            impl._locator_classes.insert(0, _locator_class(caching, config, where, files, where.name.rsplit("-", 1)[1]))
    _notices.append(_notice_class(event)(where))
    event.register("numba:compile", _notices[0])  # for the whole process
    return None if user_dir else where


def _locator_class(caching, config, where: Path, files: dict[str, str], stamp: str):
    """numba's cache locator for the files of :data:`COMPILED`: each module in
    ``where/<module name>``, stamped with the source hash (not a path or a modification time)."""

    class QkvCacheLocator(caching._CacheLocator):
        def __init__(self, py_func, module: str):
            self._lineno = py_func.__code__.co_firstlineno
            self._path = str(where / module)

        def get_cache_path(self):
            return self._path

        def get_source_stamp(self):
            return stamp

        def get_disambiguator(self):
            return str(self._lineno)

        @classmethod
        def from_function(cls, py_func, py_file):
            module = files.get(os.path.realpath(py_file))
            if module is None or config.CACHE_DIR:  # not qkv's, or the user's NUMBA_CACHE_DIR set since
                return None
            self = cls(py_func, module)
            try:
                self.ensure_cache_path()
            except OSError:  # not writable: numba's own locators are tried next
                return None
            return self

    return QkvCacheLocator


def _notice_class(event):
    """A listener on numba's compile events that prints one line at the first compile of a
    function of :data:`COMPILED` (a cache miss; a hit fires no event), then stays quiet."""

    class CompileNotice(event.Listener):
        def __init__(self, where):
            self.where, self.told, self.told_rows, self.depth, self.started = where, False, False, 0, 0.0
            self.seconds: dict[str, float] = {}   # qualified name -> seconds of its outermost compiles
            self.total = 0.0                       # seconds of every finished outermost compile

        def on_start(self, ev):
            self.depth += 1
            if self.depth == 1:
                self.started = time.perf_counter()
            func = getattr(ev.data.get("dispatcher"), "py_func", None)
            module = getattr(func, "__module__", None)
            if module not in COMPILED:
                return
            rows = module in ROW_KERNEL_MODULES
            if not self.told:
                self.told = True
                about = f"{COMPILE_ABOUT}; {ROW_KERNEL_ABOUT}" if rows else COMPILE_ABOUT
                self.told_rows = rows
                print(f"qkv: compiling the fast kernels for this CPU, once per machine and qkv version "
                      f"({about}; kept in {self.where})...", file=sys.stderr, flush=True)
            elif rows and not self.told_rows:   # the notice named only the smaller kernels so far
                self.told_rows = True
                print(f"qkv: compiling the row kernel ({ROW_KERNEL_ABOUT})...", file=sys.stderr, flush=True)

        def on_end(self, ev):
            if self.depth == 1:
                self.total += time.perf_counter() - self.started
            self.depth -= 1
            func = getattr(ev.data.get("dispatcher"), "py_func", None)
            if self.depth == 0 and func is not None:
                name = f"{func.__module__}.{func.__qualname__}"
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - self.started

    return CompileNotice
