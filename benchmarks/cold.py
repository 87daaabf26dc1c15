"""The ``cold`` suite: a job's first run on a machine (the kernels compiled) against its next (loaded).

Each job runs in a fresh Python process with ``QKV_CACHE_DIR`` set to an empty temporary
folder (``NUMBA_CACHE_DIR`` removed from its environment, so qkv's kernel cache is the one
used): that run is *cold*, numba compiles every kernel the job calls; then the same job
runs again in another fresh process on the folder the first one filled: *warm*, every
kernel loaded. Both are timed by wall clock and by CPU time (user + system of the child,
from ``resource.getrusage``): on a machine shared with other work the CPU seconds say
more than the wall ones. The child also reports which kernels it compiled and how long
each took (:func:`qkv.jit_cache.compile_seconds`), and whether it printed the compile
notice.

Jobs (:data:`JOBS`): ``layernorm`` (the encoder's residual + LayerNorm pass alone, the
quick run's only job), ``attention`` (``qkv.attention`` forward and backward, float32,
T=256: the row kernel), ``flash`` (the tiled kernel, T=2048, forward and backward),
``explain`` (``qkv explain``) and ``train-gpt`` (``qkv train gpt --steps 3``).
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

JOBS = ("layernorm", "attention", "flash", "explain", "train-gpt")
QUICK_JOBS = ("layernorm",)
NOTICE = "qkv: compiling the fast kernels"


def _attention(t: int, method: str) -> None:
    import numpy as np

    import qkv

    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 4, t, 64), dtype=np.float32) for _ in range(4))
    out, lse = qkv.attention(q, k, v, causal=True, return_lse=True, method=method)
    qkv.attention_backward(dout, q, k, v, out, lse, causal=True, method=method)


def _layernorm() -> None:
    import numpy as np

    from qkv import jit

    x = np.ones((4, 8), np.float32)
    jit.encoder().add_layer_norm(x, x, np.ones(8, np.float32), np.zeros(8, np.float32), np.float32(1e-5),
                                 np.empty_like(x))


def _cli(*argv: str) -> None:
    """``qkv ARGV`` in this process, as ``python -m qkv`` runs it."""
    import runpy

    sys.argv = ["qkv", *argv]
    try:
        runpy.run_module("qkv", run_name="__main__")
    except SystemExit as done:
        if done.code not in (0, None):
            raise SystemExit(f"qkv {' '.join(argv)} failed ({done.code})") from None


def run_job(job: str, scratch: str) -> None:
    """Run ``job`` of :data:`JOBS` in this process, writing what it writes under ``scratch``."""
    if job == "layernorm":
        _layernorm()
    elif job == "attention":
        _attention(256, "auto")
    elif job == "flash":
        _attention(2048, "flash")
    elif job == "explain":
        _cli("explain", "--out", os.path.join(scratch, "explain"))
    elif job == "train-gpt":
        _cli("train", "gpt", "--steps", "3", "--no-progress", "--out", os.path.join(scratch, "gpt"))
    else:
        raise ValueError(f"job must be one of {JOBS}; got {job!r}")


def first_call(job: str, cache: str) -> dict:
    """One fresh process running ``job`` on the kernel cache ``cache``: ``{"wall_s", "cpu_s",
    "compiled": {kernel: seconds}, "notice": bool}``."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["QKV_CACHE_DIR"] = cache
    with tempfile.TemporaryDirectory() as scratch:
        report = os.path.join(scratch, "compiled.json")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "qkv_benchmarks.cold", job, scratch, report], env=env,
                             capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if res.returncode != 0:
            raise RuntimeError(f"cold job {job!r} failed: {res.stderr.strip()[-2000:]}")
        with open(report) as f:
            compiled = json.load(f)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "compiled": compiled, "notice": NOTICE in res.stderr}


def measure(quick: bool, progress=None) -> list[dict]:
    """Per job: ``{"job", "cold": first_call(...), "warm": first_call(...)}``, cold on an empty
    cache folder, warm on the one it filled; ``progress(label)`` is told before each."""
    rows = []
    for job in QUICK_JOBS if quick else JOBS:
        with tempfile.TemporaryDirectory() as cache:
            row = {"job": job}
            for kind in ("cold", "warm"):
                if progress:
                    progress(f"{job} {kind}")
                row[kind] = first_call(job, cache)
            rows.append(row)
    return rows


def suite(quick: bool, progress) -> list[dict]:
    """:func:`measure` for :func:`qkv_benchmarks.suites.run_suites`: ``progress(advance, description)``
    advances once per fresh process (:func:`steps` of them)."""
    started = []

    def told(label):
        progress(1 if started else 0, description=f"cold: {label}")
        started.append(label)
    rows = measure(quick, told)
    progress(1)
    return rows


def steps(quick: bool) -> int:
    """How many processes :func:`measure` starts (two a job)."""
    return 2 * len(QUICK_JOBS if quick else JOBS)


def _child(argv: list[str]) -> None:
    job, scratch, report = argv
    from qkv import jit_cache

    run_job(job, scratch)
    with open(report, "w") as f:
        json.dump(jit_cache.compile_seconds(), f)


if __name__ == "__main__":
    _child(sys.argv[1:])
