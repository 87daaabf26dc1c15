"""``qkv bench``: qkv's tiled attention against dense NumPy and PyTorch SDPA, in one run.

Every case runs the three methods on the same inputs, alternating them repeat by repeat
(so a change in machine load falls on all alike) after one warm-up each, and reports the
median; a call shorter than a second is run once untimed right before each timed run, so
it does not pay for the previous method's still-spinning worker threads. Methods:

- ``qkv``: ``qkv.attention(..., method="flash")`` and ``qkv.attention_backward``;
- ``dense``: the same calls with ``method="reference"`` (softmax(QKᵀ)V, T² memory);
- ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` and autograd, with
  ``torch.set_num_threads`` equal to qkv's thread count (skipped when torch is missing).

FLOP convention (written once, here, and used for every GFLOP/s printed)::

    forward          F = 4 · B · Hq · Tq · Tk · D      (QKᵀ and PV, 2 FLOP per multiply-add)
    causal forward   F / 2                              (half the score matrix is visible)
    backward         2.5 · F                            (five products instead of two)
    forward+backward 3.5 · F

Decoding (Tq = 1) is memory-bound and reported as GB/s of K and V read,
``B · Hkv · Tk · (D + Dv) · 4`` bytes per call, next to the machine's copy bandwidth
measured in the same loop: ``np.copyto`` of as many bytes as K and V, split over the same
threads, counted as bytes read + bytes written (the STREAM "copy" convention), median.

Peak extra memory (the scaling sweep, forward+backward) is the resident-set high-water
mark of a fresh subprocess during the call minus its resident set just before it
(``/proc/self/clear_refs`` resets the mark after the inputs exist; where that is not
allowed, ``ru_maxrss`` before and after). It counts everything the call allocates,
outputs and gradients included, for NumPy and torch alike.

Suites: ``main`` (B=1, H=8, T=4096, D=64, float32, causal and not, forward and
forward+backward), ``sweep`` (one head, D=64, T = 512 ... 16384: time and peak memory),
``decode`` (Tq=1, Tk=32768, Hq=32, Hkv=8, D=128), ``encoder`` (qkv's all-MiniLM-L6-v2
encoder against sentence-transformers: 256 short sentences and 16 texts of 512 tokens; see
``encoder.py``; needs the models and test extras). ``--quick`` shrinks every size so the
whole run takes seconds (the test suite runs it end to end) and leaves the encoder out
unless ``--suite encoder`` asks for it.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

# Each timed call of a method comes right after an untimed call of the same method when
# that takes under REWARM_S seconds. Without it a short call pays for what ran before it:
# OpenBLAS's (dense) and torch's OpenMP worker threads keep spinning after their work and
# steal a core, and a core left idle comes back slowly; both distort a 30 ms decode.
REWARM_S = 1.0
SUITES = ("main", "sweep", "decode", "encoder")
QUICK_DEFAULT = ("main", "sweep", "decode")  # --quick leaves the encoder out unless asked
METHODS = ("qkv", "dense", "torch")
FULL = {
    "main": dict(b=1, h=8, t=4096, d=64),
    "sweep": dict(ts=(512, 1024, 2048, 4096, 8192, 16384), d=64, dense_max=8192),
    "decode": dict(b=1, hq=32, hkv=8, tk=32768, d=128),
}
QUICK = {
    "main": dict(b=1, h=2, t=256, d=32),
    "sweep": dict(ts=(128, 256, 512), d=32, dense_max=512),
    "decode": dict(b=1, hq=8, hkv=2, tk=2048, d=64),
}
MIB = 2 ** 20


def forward_flops(b, hq, tq, tk, d, causal):
    """4·B·Hq·Tq·Tk·D, halved when causal."""
    f = 4.0 * b * hq * tq * tk * d
    return f / 2 if causal else f


def fwd_bwd_flops(b, hq, tq, tk, d, causal):
    """Forward plus backward, the backward counted as 2.5 forwards."""
    return 3.5 * forward_flops(b, hq, tq, tk, d, causal)


def kv_bytes(b, hkv, tk, d, dv, itemsize=4):
    return b * hkv * tk * (d + dv) * itemsize


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="small sizes: the whole run takes seconds (for tests and a first look)")
    parser.add_argument("--suite", action="append", choices=SUITES + ("all",),
                        help="which suite to run (repeatable; default: all)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per method and case; the median is reported (default 5, quick 2)")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for qkv and torch (default: os.cpu_count())")
    parser.add_argument("--no-torch", action="store_true", help="leave PyTorch out even if installed")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--plot", metavar="PNG", help="also draw the scaling sweep (needs qkv[viz])")
    parser.add_argument("--json", metavar="FILE", help="also write every measurement as JSON")


# ----------------------------------------------------------------------------- inputs
def _inputs(rng, b, hq, hkv, tq, tk, d):
    import numpy as np
    q = rng.standard_normal((b, hq, tq, d), dtype=np.float32)
    k = rng.standard_normal((b, hkv, tk, d), dtype=np.float32)
    v = rng.standard_normal((b, hkv, tk, d), dtype=np.float32)
    dout = rng.standard_normal((b, hq, tq, d), dtype=np.float32)
    return q, k, v, dout


def _runner(method, q, k, v, dout, *, causal, backward, gqa=False):
    """A no-argument callable doing one forward (and backward) by ``method``."""
    if method == "torch":
        import torch
        sdpa = torch.nn.functional.scaled_dot_product_attention
        tq_, tk_, tv_ = (torch.from_numpy(x) for x in (q, k, v))
        if not backward:
            def fwd():
                with torch.no_grad():
                    return sdpa(tq_, tk_, tv_, is_causal=bool(causal), enable_gqa=gqa)
            return fwd
        tq_, tk_, tv_ = (x.clone().requires_grad_(True) for x in (tq_, tk_, tv_))
        tdo = torch.from_numpy(dout)

        def fwd_bwd():
            for x in (tq_, tk_, tv_):
                x.grad = None
            out = sdpa(tq_, tk_, tv_, is_causal=bool(causal), enable_gqa=gqa)
            out.backward(tdo)
            return tq_.grad
        return fwd_bwd

    import qkv
    name = "flash" if method == "qkv" else "reference"
    if not backward:
        return lambda: qkv.attention(q, k, v, causal=causal, gqa=gqa, method=name)

    def fwd_bwd():
        out, lse = qkv.attention(q, k, v, causal=causal, gqa=gqa, return_lse=True, method=name)
        return qkv.attention_backward(dout, q, k, v, out, lse, causal=causal, gqa=gqa, method=name)
    return fwd_bwd


def _time_all(fns: dict, repeats: int, tick) -> dict:
    """Median seconds of each callable, alternating them repeat by repeat (after one
    warm-up each); a short call is repeated untimed right before its timed run."""
    rewarm = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        rewarm[name] = time.perf_counter() - t0 < REWARM_S
        tick()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if rewarm[name]:
                fn()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            tick()
    return {name: statistics.median(ts) for name, ts in times.items()}


# ----------------------------------------------------------------------------- memory
_CHILD = """
import json, sys
from qkv_benchmarks.attention import _child
print(json.dumps(_child(*json.loads(sys.argv[1]))))
"""


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def _child(method, t, d, causal, threads):
    """In a fresh process: peak extra resident memory (bytes) of one forward+backward."""
    import resource

    import numpy as np
    if method == "torch":
        import torch
        torch.set_num_threads(threads)
    else:
        import qkv
        qkv.set_num_threads(threads)
    rng = np.random.default_rng(0)
    small = _inputs(rng, 1, 1, 1, 64, 64, d)
    _runner(method, *small, causal=causal, backward=True)()  # load libraries, start threads
    q, k, v, dout = _inputs(rng, 1, 1, 1, t, t, d)
    fn = _runner(method, q, k, v, dout, causal=causal, backward=True)
    rss0 = _status_kib("VmRSS")
    how = "VmHWM after clear_refs"
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current resident set
        before = rss0
    except OSError:
        how = "ru_maxrss"
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    after = _status_kib("VmHWM") if how != "ru_maxrss" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"extra_bytes": max(0, after - before) * 1024, "how": how}


def _peak_extra(method, t, d, causal, threads):
    env = dict(os.environ)
    res = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([method, t, d, causal, threads])],
                         capture_output=True, text=True, env=env, timeout=900)
    if res.returncode != 0:
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- copy
def copier(nbytes: int, threads: int):
    """A callable copying ``nbytes`` (float32) with ``np.copyto`` split over ``threads``
    threads: the machine's copy bandwidth, timed alongside the decoding it is compared to."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    n = nbytes // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    cuts = np.linspace(0, n, threads + 1).astype(int)
    parts = [(dst[a:b], src[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    pool = ThreadPoolExecutor(threads)
    copy = lambda: list(pool.map(lambda p: np.copyto(*p), parts))  # noqa: E731
    copy.close = lambda: pool.shutdown(wait=True)
    return copy


# ----------------------------------------------------------------------------- suites
def _count_steps(suites, cfg, methods, memory):
    n = 0
    per = len(methods) * (1 + cfg["repeats"])
    if "main" in suites:
        n += 4 * per
    if "sweep" in suites:
        sw = cfg["sweep"]
        for t in sw["ts"]:
            m = [x for x in methods if x != "dense" or t <= sw["dense_max"]]
            n += len(m) * (1 + cfg["repeats"]) + (len(m) if memory else 0)
    if "decode" in suites:
        n += (len(methods) + 1) * (1 + cfg["repeats"])
    if "encoder" in suites:
        n += 1
    return n


def run_suites(args) -> dict:
    """Run the chosen suites; returns every measurement (seconds, FLOP, bytes)."""
    import numpy as np

    import qkv
    from qkv.extras import require

    rich_progress = require("rich.progress", "cli")
    from .report import console
    cfg = dict(QUICK if args.quick else FULL)
    cfg["repeats"] = args.repeats or (2 if args.quick else 5)
    threads = args.threads or os.cpu_count() or 1
    if args.suite and "all" in args.suite:
        suites = set(SUITES)
    elif args.suite:
        suites = set(args.suite)
    else:
        suites = set(QUICK_DEFAULT if args.quick else SUITES)
    methods = ["qkv", "dense"]
    torch_version = None
    if not args.no_torch:
        try:
            import torch
            torch.set_num_threads(threads)
            methods.append("torch")
            torch_version = torch.__version__
        except ImportError:
            pass
    qkv.set_num_threads(threads)
    memory = not args.no_memory
    rng = np.random.default_rng(0)
    results = {"threads": threads, "quick": bool(args.quick), "repeats": cfg["repeats"],
               "torch": torch_version, "blas": _blas_info(), "main": [], "sweep": [], "decode": [],
               "encoder": [], "encoder_skipped": None}

    progress = rich_progress.Progress(
        rich_progress.TextColumn("{task.description}"), rich_progress.BarColumn(),
        rich_progress.MofNCompleteColumn(), rich_progress.TimeElapsedColumn(),
        transient=True, console=console(stderr=True))
    with progress:
        task = progress.add_task("qkv bench", total=_count_steps(suites, cfg, methods, memory))

        def tick():
            progress.advance(task)

        if "main" in suites:
            c = cfg["main"]
            q, k, v, dout = _inputs(rng, c["b"], c["h"], c["h"], c["t"], c["t"], c["d"])
            for backward in (False, True):
                for causal in (False, True):
                    label = f"{'fwd+bwd' if backward else 'fwd'} {'causal' if causal else 'full'}"
                    progress.update(task, description=f"main: {label}")
                    fns = {m: _runner(m, q, k, v, dout, causal=causal, backward=backward) for m in methods}
                    secs = _time_all(fns, cfg["repeats"], tick)
                    flops = (fwd_bwd_flops if backward else forward_flops)(
                        c["b"], c["h"], c["t"], c["t"], c["d"], causal)
                    results["main"].append({"case": label, "shape": dict(c), "causal": causal,
                                            "backward": backward, "flop": flops, "seconds": secs})
        if "sweep" in suites:
            sw = cfg["sweep"]
            for t in sw["ts"]:
                progress.update(task, description=f"sweep: T={t}")
                m = [x for x in methods if x != "dense" or t <= sw["dense_max"]]
                q, k, v, dout = _inputs(rng, 1, 1, 1, t, t, sw["d"])
                fns = {x: _runner(x, q, k, v, dout, causal=False, backward=True) for x in m}
                secs = _time_all(fns, cfg["repeats"], tick)
                del q, k, v, dout, fns
                peak = {}
                if memory:
                    for x in m:
                        progress.update(task, description=f"sweep: T={t} memory ({x})")
                        peak[x] = _peak_extra(x, t, sw["d"], False, threads)
                        tick()
                results["sweep"].append({"t": t, "d": sw["d"], "seconds": secs,
                                         "flop": fwd_bwd_flops(1, 1, t, t, sw["d"], False),
                                         "peak": peak})
        if "decode" in suites:
            c = cfg["decode"]
            progress.update(task, description="decode")
            q, k, v, dout = _inputs(rng, c["b"], c["hq"], c["hkv"], 1, c["tk"], c["d"])
            nbytes = kv_bytes(c["b"], c["hkv"], c["tk"], c["d"], c["d"])
            fns = {m: _runner(m, q, k, v, dout, causal=False, backward=False, gqa=True) for m in methods}
            fns["copy"] = copier(nbytes, threads)  # as many bytes as K and V, in the same loop
            secs = _time_all(fns, cfg["repeats"], tick)
            fns["copy"].close()
            del q, k, v, dout, fns
            copy_s = secs.pop("copy")
            results["decode"].append({"shape": dict(c), "seconds": secs, "copy_seconds": copy_s,
                                      "copy_bytes_per_s": 2 * nbytes / copy_s, "bytes": nbytes})
        if "encoder" in suites:
            progress.update(task, description="encoder: qkv vs sentence-transformers")
            results["encoder"], results["encoder_skipped"] = _encoder_suite(cfg["repeats"], args.quick)
            tick()
    return results


def _encoder_suite(repeats: int, quick: bool):
    """``(rows, None)`` from encoder.measure, or ``([], reason)`` when a part is missing."""
    try:
        import sentence_transformers  # noqa: F401
        import torch  # noqa: F401

        from qkv.models import default_model_path
        default_model_path()
    except Exception as err:  # a missing extra or model: say so in the report, run the rest
        return [], f"{type(err).__name__}: {err}"
    from .encoder import measure
    return measure(repeats, n_short=16 if quick else 256, n_long=2 if quick else 16), None


def _blas_info() -> dict:
    info = {"env": {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ}}
    try:
        from threadpoolctl import threadpool_info
        blas = [x for x in threadpool_info() if x.get("user_api") == "blas"]
        if blas:
            info.update(kernel=blas[0].get("architecture"), library=blas[0].get("internal_api"),
                        version=blas[0].get("version"))
    except Exception:  # informational only
        pass
    return info


def run(args) -> int:
    from qkv.cli.common import out_file
    from qkv.extras import require

    from .report import plot, report
    from qkv.errors import ShapeError

    require("rich", "cli")
    if args.repeats is not None and args.repeats < 1:
        raise ShapeError(f"--repeats must be >= 1; got {args.repeats}")
    if args.threads is not None and args.threads < 1:
        raise ShapeError(f"--threads must be >= 1; got {args.threads}")
    if args.plot:
        require("matplotlib", "viz")
        out_file(args.plot, "--plot", (".png", ".svg", ".pdf"))
    if args.json:
        out_file(args.json, "--json")  # both checked before minutes of measuring, not after
    results = run_suites(args)
    report(results)
    if args.plot and results["sweep"]:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"json: {args.json}")
    return 0
