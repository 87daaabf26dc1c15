"""``qkv experiment complexity``: what attention costs as the sequence grows, measured.

The texts point to "the cost of the QKᵀ matrix": softmax attention compares every query
with every key, so its work grows like T² whatever the implementation; the question is
what memory it needs and how the alternatives compare. Measured here, causal, one head,
D = 64, float32, for T = 256 … 65536:

- ``dense``: ``qkv.attention(method="reference")``, which builds the (T, T) scores:
  time ~T², memory ~T²;
- ``flash``: ``qkv.attention(method="flash")``, the tiled kernel: time ~T², memory ~T·D;
- ``chunked``: ``qkv.attention(chunk=1024)`` (Llama 4's chunked attention: each query sees
  its own chunk of 1024 keys): time ~T·C. Measured only where ``qkv.attention`` takes
  ``chunk=``; elsewhere the record says it was skipped;
- ``linear``: :func:`qkv.linear_attention` (φ = elu + 1): time ~T·D², memory ~T·D.

Each method runs forward and forward+backward at growing T until its next run would need
more than ``memory_limit_mib`` (or ``time_limit_s``), predicted from its last two runs.
Times are the minimum over up to ``repeats`` runs. Peak memory is the high-water mark of
the allocations traced by :mod:`tracemalloc` during one run: NumPy reports its array
buffers there, so this counts every array a method makes (inputs excluded), but not
BLAS's internal work buffers or the interpreter. Slopes are least-squares fits of
log(cost) on log(T) over the runs with ``T >= fit_from`` (small T measures overheads).

Decoding one token at context length L (``nn.MultiHeadAttention`` reading a KV cache of
L tokens vs ``nn.LinearAttention`` updating its state, d_model = 64, one head, BLAS on one
thread): median seconds per token and the bytes each keeps.
"""
from __future__ import annotations

import inspect
import math
import time
import tracemalloc
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from ..api import attention, attention_backward
from ..errors import ShapeError
from ..linear_api import linear_attention, linear_attention_backward
from ..nn import LinearAttention, MultiHeadAttention
from ..kernels.flash import EXP_PATH
from ..threads import get_num_threads, kernel_threads

METHODS = ("dense", "flash", "chunked", "linear")
# "wall": what a user waits; "cpu": the CPU seconds of this process (all its threads), which
# other processes on a shared machine barely change (with threads=1 it is the work done).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CHUNK = 1024
MIB = 2.0 ** 20


def _powers(lo: int, hi: int) -> tuple[int, ...]:
    return tuple(2 ** e for e in range(int(math.log2(lo)), int(math.log2(hi)) + 1))


@dataclass
class ComplexityConfig:
    """Settings of ``qkv experiment complexity`` (the defaults are the full run; see :meth:`quick`)."""

    ts: tuple = _powers(256, 65536)
    decode_ts: tuple = _powers(256, 65536)
    d: int = 64
    repeats: int = 3
    min_seconds: float = 0.3       # stop repeating once this much was spent on one point
    memory_limit_mib: float = 6144.0
    time_limit_s: float = 120.0    # predicted seconds of one forward+backward
    decode_tokens: int = 20
    fit_from: int = 4096           # slopes from here on: below it, fixed costs blur them
    seed: int = 0
    methods: tuple = METHODS
    threads: int | None = None     # kernel and BLAS threads while measuring (None: as they are)
    clock: str = "wall"            # "wall" seconds, or "cpu": this process's CPU seconds

    @classmethod
    def quick(cls) -> "ComplexityConfig":
        """Under a minute: T up to 4096, one run per point."""
        return cls(ts=_powers(256, 4096), decode_ts=_powers(256, 4096), repeats=1, min_seconds=0.0,
                   memory_limit_mib=1024.0, time_limit_s=10.0, decode_tokens=5, fit_from=1024)

    def check(self) -> None:
        if not self.ts or any(int(t) < 1 for t in self.ts) or any(int(t) < 1 for t in self.decode_ts):
            raise ShapeError(f"ts and decode_ts must be sequence lengths >= 1; got {self.ts} and {self.decode_ts}")
        for name in ("d", "repeats", "decode_tokens"):
            if getattr(self, name) < 1:
                raise ShapeError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.clock not in CLOCKS:
            raise ShapeError(f"clock must be one of {tuple(CLOCKS)}; got {self.clock!r}")
        if self.threads is not None and self.threads < 1:
            raise ShapeError(f"threads must be >= 1 or None; got {self.threads}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ShapeError(f"methods must be among {METHODS}; got {unknown}")

    @property
    def n_steps(self) -> int:
        """How many times ``progress`` is called: one per (method, T) and one per decode length."""
        return len(self.methods) * len(self.ts) + len(self.decode_ts)


def chunk_supported() -> bool:
    """Whether :func:`qkv.attention` takes ``chunk=`` (Llama 4's chunked attention)."""
    return "chunk" in inspect.signature(attention).parameters


def _runner(method: str):
    """``(forward, backward)`` for one method: forward returns what backward needs."""
    if method == "linear":
        def fwd(q, k, v):
            return linear_attention(q, k, v, causal=True)

        def bwd(saved, q, k, v):
            return linear_attention_backward(np.ones_like(saved), q, k, v, causal=True)
        return fwd, bwd
    opts = {"dense": dict(method="reference"), "flash": dict(method="flash"),
            "chunked": dict(method="flash", chunk=CHUNK)}[method]

    def fwd(q, k, v):
        return attention(q, k, v, causal=True, return_lse=True, **opts)

    def bwd(saved, q, k, v):
        out, lse = saved
        return attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True, **opts)
    return fwd, bwd


def _measure(method: str, t: int, cfg: ComplexityConfig, rng: np.random.Generator) -> dict:
    """Seconds and traced peak MiB of one forward and of one forward+backward at length t."""
    q, k, v = (rng.standard_normal((1, 1, t, cfg.d), dtype=np.float32) for _ in range(3))  # (B, H, T, D)
    fwd, bwd = _runner(method)
    EXP_PATH()  # the kernel's one-time choice of its exponential (and numba's compile) is not traced
    tracemalloc.start()
    try:
        saved = fwd(q, k, v)
        peak_fwd = tracemalloc.get_traced_memory()[1]
        bwd(saved, q, k, v)
        peak_all = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del saved
    f_times, fb_times, spent = [], [], 0.0
    clock = CLOCKS[cfg.clock]
    while len(f_times) < cfg.repeats and (not f_times or spent < cfg.min_seconds):
        t0 = clock()
        saved = fwd(q, k, v)
        t1 = clock()
        bwd(saved, q, k, v)
        t2 = clock()
        del saved
        f_times.append(t1 - t0)
        fb_times.append(t2 - t0)
        spent += t2 - t0
    return {"seconds": min(f_times), "seconds_fwd_bwd": min(fb_times),
            "peak_mib": peak_fwd / MIB, "peak_mib_fwd_bwd": peak_all / MIB}


def _predict(ts: list, values: list, t: int, default_slope: float) -> float:
    """Extrapolate ``values`` (measured at ``ts``) to ``t`` along the last two points' slope."""
    if len(ts) >= 2 and values[-1] > 0 and values[-2] > 0:
        slope = math.log(values[-1] / values[-2]) / math.log(ts[-1] / ts[-2])
    else:
        slope = default_slope
    return values[-1] * (t / ts[-1]) ** max(slope, 1.0)


def slope(ts, values, fit_from: int = 1) -> float | None:
    """Least-squares slope of log(value) against log(T) over the points with ``T >= fit_from``
    (all points when fewer than two qualify); None with fewer than two values."""
    pts = [(t, y) for t, y in zip(ts, values) if y is not None and y > 0]
    use = [p for p in pts if p[0] >= fit_from]
    use = use if len(use) >= 2 else pts
    if len(use) < 2:
        return None
    x, y = np.log([p[0] for p in use]), np.log([p[1] for p in use])
    return float(np.polyfit(x, y, 1)[0])


def crossover(ts, linear, flash) -> int | None:
    """The smallest T from which linear attention is faster than the tiled kernel at every
    larger T measured for both (None if it never is)."""
    both = [(t, a, b) for t, a, b in zip(ts, linear, flash) if a is not None and b is not None]
    found = None
    for t, a, b in reversed(both):
        if a < b:
            found = t
        else:
            break
    return found


def _decode(context: int, cfg: ComplexityConfig, rng: np.random.Generator) -> dict:
    """Seconds per decoded token and bytes kept, KV cache against linear state, at one context length."""
    d, n = cfg.d, cfg.decode_tokens
    x = rng.standard_normal((1, n, d), dtype=np.float32)  # (B, T, d_model): the tokens decoded
    mha = MultiHeadAttention(d, 1, causal=True, rng=np.random.default_rng(cfg.seed))
    cache = mha.new_cache(1, context + n)
    cache.write(k=rng.standard_normal((1, 1, context, d), dtype=np.float32),
                v=rng.standard_normal((1, 1, context, d), dtype=np.float32))
    cache.advance(context)
    cache_bytes = 2 * context * d * 4  # the keys and values of `context` tokens (float32)
    lin = LinearAttention(d, 1, causal=True, rng=np.random.default_rng(cfg.seed))
    state = lin.new_state(1)
    state.length = context  # its size does not depend on what it holds
    clock = CLOCKS[cfg.clock]
    times = {"kv_cache": [], "linear_state": []}
    # Each method decodes its tokens in a run of its own (one's reads would evict the other's
    # state from the caches), with BLAS on one thread: the products are small, and a second
    # BLAS thread on a busy machine only adds waits.
    with threadpool_limits(limits=1, user_api="blas"):
        for name, step in (("kv_cache", lambda i: mha.forward(x[:, i:i + 1], cache=cache)),
                           ("linear_state", lambda i: lin.forward(x[:, i:i + 1], state=state))):
            for i in range(n):
                t0 = clock()
                step(i)
                times[name].append(clock() - t0)
    return {"kv_cache": (float(np.median(times["kv_cache"])), cache_bytes),
            "linear_state": (float(np.median(times["linear_state"])), state.nbytes)}


@contextmanager
def _threads(n: int | None):
    """Kernel threads and BLAS threads held to ``n`` inside (nothing changes for None)."""
    if n is None:
        yield
        return
    with kernel_threads(n), threadpool_limits(limits=n, user_api="blas"):  # this thread's calls only
        yield


def complexity_experiment(cfg: ComplexityConfig | None = None, progress=None) -> dict:
    """Run the measurements (with ``cfg.threads`` threads); returns the record written as
    ``complexity.json``. The table and the picture: :mod:`qkv.experiments.complexity_report`.

    ``progress(done, total, what)`` is called after each step (``cfg.n_steps`` in all).
    Keys: ``T``; ``methods[m]`` with ``seconds``, ``peak_mib`` (forward), ``seconds_fwd_bwd``,
    ``peak_mib_fwd_bwd`` (lists over T, None where not run) and ``stopped`` (why it stopped
    early, or None); ``slopes`` (``<m>_time``, ``<m>_memory``, ``<m>_time_fwd_bwd``,
    ``<m>_memory_fwd_bwd``); ``crossover`` (smallest T from which linear beats flash, forward
    and forward+backward); ``decode``; ``notes``; ``config``.
    """
    cfg = cfg or ComplexityConfig()
    cfg.check()
    with _threads(cfg.threads):
        return _run(cfg, progress)


def _run(cfg: ComplexityConfig, progress) -> dict:
    rng = np.random.default_rng(cfg.seed)
    ts = [int(t) for t in cfg.ts]
    total, done = cfg.n_steps, 0
    keys = ("seconds", "peak_mib", "seconds_fwd_bwd", "peak_mib_fwd_bwd")
    methods, notes = {}, {
        "memory": "peak_mib: high-water mark of the allocations traced by tracemalloc during one call "
                  "(NumPy's array buffers; inputs, BLAS work buffers and the interpreter excluded)",
        "seconds": f"{'wall-clock' if cfg.clock == 'wall' else 'CPU'} seconds, minimum over up to "
                   f"{cfg.repeats} runs; causal, B = H = 1, D = {cfg.d}, float32, {get_num_threads()} kernel threads",
    }
    notes["slopes"] = f"least-squares slopes of log(cost) on log(T) over the runs with T >= {cfg.fit_from}"
    chunked_ok = chunk_supported()
    if not chunked_ok:
        notes["chunked"] = ("skipped: this qkv.attention has no chunk= option yet; the method runs as "
                            f"qkv.attention(q, k, v, causal=True, chunk={CHUNK}) once it has")
    for m in cfg.methods:
        rec = {key: [None] * len(ts) for key in keys}
        rec["stopped"] = None
        run_t, run_mem, run_time = [], [], []
        for i, t in enumerate(ts):
            if m == "chunked" and not chunked_ok:
                rec["stopped"] = "no chunk= in qkv.attention"
            elif rec["stopped"] is None and run_t:
                mem = _predict(run_t, run_mem, t, 2.0)
                sec = _predict(run_t, run_time, t, 2.0)
                if mem > cfg.memory_limit_mib:
                    rec["stopped"] = f"T = {t}: predicted {mem:.0f} MiB > memory limit {cfg.memory_limit_mib:.0f} MiB"
                elif sec > cfg.time_limit_s:
                    rec["stopped"] = f"T = {t}: predicted {sec:.0f} s > time limit {cfg.time_limit_s:.0f} s"
            if rec["stopped"] is None:
                row = _measure(m, t, cfg, rng)
                for key in keys:
                    rec[key][i] = row[key]
                run_t.append(t)
                run_mem.append(max(row["peak_mib_fwd_bwd"], 1e-3))
                run_time.append(row["seconds_fwd_bwd"])
            done += 1
            if progress is not None:
                progress(done, total, f"{m} T={t}")
        methods[m] = rec
    slopes = {}
    for m, rec in methods.items():
        for name, key in (("time", "seconds"), ("memory", "peak_mib"), ("time_fwd_bwd", "seconds_fwd_bwd"),
                          ("memory_fwd_bwd", "peak_mib_fwd_bwd")):
            slopes[f"{m}_{name}"] = slope(ts, rec[key], cfg.fit_from)
    cross = {}
    if "linear" in methods and "flash" in methods:
        for key in ("seconds", "seconds_fwd_bwd"):
            cross[key] = crossover(ts, methods["linear"][key], methods["flash"][key])
    decode = {"context": [int(c) for c in cfg.decode_ts],
              "kv_cache": {"seconds_per_token": [], "bytes": []},
              "linear_state": {"seconds_per_token": [], "bytes": []}}
    for c in decode["context"]:
        row = _decode(c, cfg, rng)
        for name in ("kv_cache", "linear_state"):
            decode[name]["seconds_per_token"].append(row[name][0])
            decode[name]["bytes"].append(row[name][1])
        done += 1
        if progress is not None:
            progress(done, total, f"decode L={c}")
    config = asdict(cfg)
    config["ts"], config["decode_ts"], config["methods"] = list(cfg.ts), list(cfg.decode_ts), list(cfg.methods)
    return {"T": ts, "methods": methods, "slopes": slopes, "crossover": cross, "decode": decode,
            "notes": notes, "config": config}
