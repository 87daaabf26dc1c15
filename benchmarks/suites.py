"""The suites of ``qkv bench``, their sizes, and :func:`run_suites` that measures them.

Suites: ``main`` (B=1, H=8, T=4096, D=64, float32, causal and not, forward and
forward+backward), ``sweep`` (one head, D=64, T = 512 ... 16384: time and peak memory),
``decode`` (Tq=1, Tk=32768, Hq=32, Hkv=8, D=128), ``encoder`` (qkv's all-MiniLM-L6-v2
encoder against sentence-transformers; see ``encoder.py``; needs the models and test
extras), ``torch`` (``qkv.torch.attention`` against qkv on NumPy and SDPA; see
``torch_suite.py``; needs the torch extra) and ``ring`` (ring attention over the ranks of
``MPI.COMM_WORLD`` against one process; see ``ring.py``; needs the mpi extra, and is meant
to run under ``mpiexec -n W``) and ``gpt`` (nanoGPT's CPU recipe trained by qkv's GPT and by a
plain PyTorch GPT, same weights, batches and threads; see ``gpt_suite.py``; without torch
qkv's side alone) and ``shapes`` (training and serving shapes, short sequences in big
batches, qkv ``method="auto"`` against SDPA; see ``shapes_suite.py``; needs the torch extra) and
``train-mpi`` (qkv's GPT trained data- and context-parallel by the ranks of ``MPI.COMM_WORLD``
against one process; see ``train_mpi.py``; needs the mpi extra, meant for ``mpiexec -n W``) and ``cold``
(first calls in fresh processes, the kernels compiled into an empty cache and then loaded; see ``cold.py``).
``recurrent`` (the recurrences of qkv.recurrent against torch chunk forms, growth in T, decoding with a state
against a KV cache; see ``recurrent_suite.py``; needs the torch, test and hf extras). ``hybrid`` (the CPU recipe
trained with each layer pattern) and ``hybrid-decode`` (a cached decoding step at 1k to 64k tokens of context per
pattern): see ``hybrid_suite.py``. ``hf-hybrid``: transformers' hybrids on qkv's recurrent kernel functions
against their torch fallbacks (``hf_hybrid_suite.py``). Without a choice a run measures :data:`DEFAULT` (a quick run
:data:`QUICK_DEFAULT`); the others run when named (or with "all"). A suite whose
extra is missing is skipped with the reason in ``results["skipped"]``.

A quick plan shrinks every size so the whole run takes seconds: a smoke test that every
path runs (the test suite runs it end to end), not a measurement: at such sizes call
overheads decide the times, and the qkv/torch ratio swings from run to run.

Under MPI (the ring and train-mpi suites) every rank calls :func:`run_suites`: those are measured by
all of them together, then rank 0 alone runs the other suites while the others wait
without spinning, and only rank 0 gets the results (the others get None).

Nothing here prints: progress goes to a callback ``progress(advance, description=None)``
and the results come back as one dict of plain numbers (what ``--json`` writes).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from .catalog import SUITE_HELP
from . import cold, gpt_suite, hf_hybrid_suite, hf_suite, hybrid_suite, products, recurrent_suite, shapes_suite, torch_suite, train_mpi
from .attention import fwd_bwd_flops, forward_flops, inputs, kv_bytes, copier, runner
from .memory import peak_extra
from .timing import REWARM_S, alternate, walls

SUITES = tuple(SUITE_HELP)  # in the order qkv bench --help lists them (catalog.py)
MPI_SUITES = ("ring", "train-mpi")  # every rank of mpiexec -n W takes part
DEFAULT = ("main", "sweep", "decode", "encoder")  # the others run when named
QUICK_DEFAULT = ("main", "sweep", "decode")  # a quick run leaves the encoder out unless asked
# What each suite needs beyond the core, as the extra that brings it (said when one is skipped).
EXTRAS = {"encoder": "models,test", "torch": "torch", "ring": "mpi", "gpt": "torch", "shapes": "torch",
          "train-mpi": "mpi", "hf": "hf", "hf-hybrid": "hf"}
FULL = {
    "main": dict(b=1, h=8, t=4096, d=64),
    "sweep": dict(ts=(512, 1024, 2048, 4096, 8192, 16384), d=64, dense_max=8192),
    "decode": dict(b=1, hq=32, hkv=8, tk=32768, d=128),
    "torch": torch_suite.FULL,
    # T is cut to the largest multiple of 2W (zigzag's chunks) at or below it
    "ring": dict(t=16384, h=1, d=64, pingpong_bytes=64 << 20),
    "train-mpi": train_mpi.FULL,
    "repeats": 5,
}
QUICK = {
    "main": dict(b=1, h=2, t=256, d=32),
    "sweep": dict(ts=(128, 256, 512), d=32, dense_max=512),
    "decode": dict(b=1, hq=8, hkv=2, tk=2048, d=64),
    "torch": torch_suite.QUICK,
    "ring": dict(t=384, h=1, d=32, pingpong_bytes=1 << 20),
    "train-mpi": train_mpi.QUICK,
    "repeats": 1,
}
# softcap and dropout against the plain tiled kernel (issue 21's budgets: 1.15x and 1.3x)
OPTION_COSTS = (("softcap=50", dict(softcap=50.0), 1.15), ("dropout_p=0.1", dict(dropout_p=0.1, dropout_seed=0), 1.3))


def _option_costs(c, q, k, v, dout, timed, progress) -> list:
    """Forward+backward of the tiled kernel with each option of :data:`OPTION_COSTS` against
    the plain one, alternated on the same inputs: ``{"case", "seconds": {plain, option}, "ratio"}``."""
    rows = []
    for label, extra, budget in OPTION_COSTS:
        progress(0, description=f"main: fwd+bwd {label}")
        secs = timed({"plain": runner("qkv", q, k, v, dout, causal=False, backward=True),
                      "option": runner("qkv", q, k, v, dout, causal=False, backward=True, **extra)})
        rows.append({"case": f"fwd+bwd full {label}", "shape": dict(c), "seconds": secs,
                     "ratio": secs["option"] / secs["plain"], "budget": budget})
    return rows


SMOKE_NOTE = ("quick sizes are a smoke test that every path runs, not a measurement: at these sizes call "
              "overheads decide the times and qkv/torch swings widely from run to run (torch's peak memory "
              "is left out); for numbers run qkv bench without --quick")


@dataclass(frozen=True)
class Plan:
    """What one run measures. Make it with :func:`plan`."""
    suites: tuple[str, ...]
    quick: bool
    repeats: int
    threads: int
    torch: bool
    memory: bool
    steps: int | None = None   # gpt suite: training steps (None: gpt_suite.STEPS)
    data: str | None = None    # gpt suite: the text to train on (None: Shakespeare; quick: a built-in text)
    gpu_size: bool = True      # gpt suite: also a step at nanoGPT's GPU recipe's size (minutes on these CPUs)

    @property
    def sizes(self) -> dict:
        return QUICK if self.quick else FULL


def plan(suites=None, *, quick=False, repeats=None, threads=None, torch=True, memory=True, steps=None,
         data=None, gpu_size=True) -> Plan:
    """A :class:`Plan`; ``suites`` None means :data:`DEFAULT` (a quick run:
    :data:`QUICK_DEFAULT`), containing "all" every suite; ``torch`` False leaves PyTorch
    out (its suite is then skipped), as does its absence. ``steps`` and ``data``: the gpt
    suite's training steps and text file."""
    from qkv.errors import ShapeError, positive_int

    if suites and "all" in suites:
        chosen = SUITES
    elif suites:
        unknown = sorted(set(suites) - set(SUITES))
        if unknown:
            raise ShapeError(f"suites must be among {SUITES + ('all',)}; got {unknown}")
        chosen = tuple(s for s in SUITES if s in suites)
    else:
        chosen = QUICK_DEFAULT if quick else DEFAULT
    repeats = positive_int("repeats", repeats) if repeats is not None else (QUICK if quick else FULL)["repeats"]
    threads = positive_int("threads", threads) if threads is not None else os.cpu_count() or 1
    torch = bool(torch) and importlib.util.find_spec("torch") is not None  # imported when the run starts
    steps = positive_int("steps", steps) if steps is not None else None
    return Plan(chosen, bool(quick), repeats, threads, torch, bool(memory), steps, data, bool(gpu_size))


def methods(p: Plan) -> list[str]:
    return ["qkv", "dense"] + (["torch"] if p.torch else [])


def _sweep_methods(p: Plan, t: int) -> list[str]:
    return [m for m in methods(p) if m != "dense" or t <= p.sizes["sweep"]["dense_max"]]


def _memory_jobs(p: Plan) -> list[tuple[str, list[int]]]:
    """(method, sizes) per fresh process: one per size else; in a quick run one per method,
    torch left out (a fresh process importing torch takes longer than the rest of the run)."""
    ts = p.sizes["sweep"]["ts"]
    if p.quick:
        return [(m, [t for t in ts if m in _sweep_methods(p, t)]) for m in methods(p) if m != "torch"]
    return [(m, [t]) for t in ts for m in _sweep_methods(p, t)]


def count_steps(p: Plan) -> int:
    """How many times :func:`run_suites` advances its progress (the bar's total)."""
    per = 1 + p.repeats
    n = 0
    if "main" in p.suites:
        n += 4 * (len(methods(p)) + 1) * per  # + the products-only bound
        n += len(OPTION_COSTS) * 2 * per       # softcap and dropout, each against the plain kernel
    if "sweep" in p.suites:
        n += sum(len(_sweep_methods(p, t)) * per for t in p.sizes["sweep"]["ts"])
        n += len(_memory_jobs(p)) if p.memory else 0
    if "decode" in p.suites:
        n += (len(methods(p)) + 1) * per
    if "encoder" in p.suites:
        n += 1
    if "torch" in p.suites:
        n += len(torch_suite_steps(p))
    if "ring" in p.suites:
        n += len(RING_LAYOUTS) + 1  # each layout, then the ping-pong
    if "train-mpi" in p.suites:
        n += len(train_mpi.MODES)
    if "gpt" in p.suites:
        n += gpt_suite.count(p.quick, p.steps, p.torch, p.memory, p.gpu_size)
    if "shapes" in p.suites and p.torch:
        n += len(shapes_suite.cases(p.quick))
    if "hf" in p.suites and p.torch:
        n += len(hf_suite.cases(p.quick))
    if "cold" in p.suites:
        n += cold.steps(p.quick)
    if "recurrent" in p.suites and p.torch and not recurrent_suite.peer_missing():
        n += recurrent_suite.steps(p.quick)
    n += hybrid_suite.lm_count(p.quick) if "hybrid" in p.suites else 0
    n += hf_hybrid_suite.count(p.quick) if "hf-hybrid" in p.suites else 0
    return n + (hybrid_suite.decode_count(p.quick) if "hybrid-decode" in p.suites else 0)


RING_LAYOUTS = (("zigzag", True), ("contiguous", False))  # (layout, also time one process)


def torch_suite_steps(p: Plan) -> list[str]:
    """The progress labels :func:`torch_suite.measure` gives, in order (one step each)."""
    labels = [f"{case} {pass_}" for case in p.sizes["torch"] for pass_ in torch_suite.PASSES]
    return [x for label in labels for x in ([label, f"{label}: peak memory"] if _torch_memory(p) else [label])]


def _torch_memory(p: Plan) -> bool:
    """Peak memory in the torch suite: fresh processes that import torch, so not in a quick run."""
    return p.memory and not p.quick


def run_suites(p: Plan, progress=None) -> dict | None:
    """Run the suites of ``p``; returns every measurement (seconds, FLOP, bytes) and the
    machine it ran on. ``progress(advance, description=None)`` is told of each step.

    With the ring suite, call it on every rank of ``MPI.COMM_WORLD``: ranks other than 0
    return None once rank 0 is done (see the module docstring)."""
    import numpy as np

    import qkv

    from .machine import describe

    progress = progress or (lambda advance, description=None: None)
    tick = lambda: progress(1)  # noqa: E731
    ring = _ring_suite(p, progress) if "ring" in p.suites else None  # first: every rank takes part
    trained = _train_mpi_suite(p, progress) if "train-mpi" in p.suites else None
    mpi = ring or trained
    if mpi and mpi["rank"] != 0:
        mpi["wait"]()  # idle until rank 0 has run the other suites
        return None
    if p.torch:
        import torch
        torch.set_num_threads(p.threads)
    qkv.set_num_threads(p.threads)
    rng = np.random.default_rng(0)
    results = {"threads": p.threads, "quick": p.quick, "repeats": p.repeats,
               "note": SMOKE_NOTE if p.quick else None,
               "torch": torch.__version__ if p.torch else None, "machine": describe(p.torch),
               "main": [], "sweep": [], "decode": [], "encoder": [], "torch_suite": [], "ring": [], "gpt": [], "shapes": [],
               "hf": [], "train_mpi": [], "options": [], "cold": [], "recurrent": [], "hybrid": [], "hybrid_decode": [],
               "hf_hybrid": [],
               "ring_pingpong_gb_s": None, "mpi_ranks": None, "skipped": {}}
    ms = methods(p)

    def timed(fns):  # a quick run times each call once after its warm-up: nothing to re-warm for
        return walls(alternate(fns, p.repeats, rewarm_below=0 if p.quick else REWARM_S, tick=tick))

    if "main" in p.suites:
        c = p.sizes["main"]
        q, k, v, dout = inputs(rng, c["b"], c["h"], c["h"], c["t"], c["t"], c["d"])
        for backward in (False, True):
            for causal in (False, True):
                label = f"{'fwd+bwd' if backward else 'fwd'} {'causal' if causal else 'full'}"
                progress(0, description=f"main: {label}")
                fns = {m: runner(m, q, k, v, dout, causal=causal, backward=backward) for m in ms}
                fns["products"] = products.runner(q, k, v, dout, causal=causal, backward=backward, threads=p.threads)
                secs = timed(fns)
                flops = (fwd_bwd_flops if backward else forward_flops)(c["b"], c["h"], c["t"], c["t"], c["d"], causal)
                results["main"].append({"case": label, "shape": dict(c), "causal": causal,
                                        "backward": backward, "flop": flops, "seconds": secs})
        results["options"] = _option_costs(c, q, k, v, dout, timed, progress)
    if "sweep" in p.suites:
        results["sweep"] = _sweep(p, rng, timed, progress, tick)
    if "decode" in p.suites:
        c = p.sizes["decode"]
        progress(0, description="decode")
        q, k, v, dout = inputs(rng, c["b"], c["hq"], c["hkv"], 1, c["tk"], c["d"])
        nbytes = kv_bytes(c["b"], c["hkv"], c["tk"], c["d"], c["d"])
        fns = {m: runner(m, q, k, v, dout, causal=False, backward=False, gqa=True) for m in ms}
        fns["copy"] = copier(nbytes, p.threads)  # as many bytes as K and V, in the same loop
        secs = timed(fns)
        fns["copy"].close()
        del q, k, v, dout, fns
        copy_s = secs.pop("copy")
        results["decode"].append({"shape": dict(c), "seconds": secs, "copy_seconds": copy_s,
                                  "copy_bytes_per_s": 2 * nbytes / copy_s, "bytes": nbytes})
    if "encoder" in p.suites:
        progress(0, description="encoder: qkv vs sentence-transformers")
        results["encoder"], results["skipped"]["encoder"] = _encoder_suite(p)
        tick()
    if "torch" in p.suites:
        results["torch_suite"], results["skipped"]["torch"] = _torch_suite(p, progress)
    if "gpt" in p.suites:
        results["gpt"], results["skipped"]["gpt"] = gpt_suite.suite(p, progress)
    if "shapes" in p.suites:
        results["shapes"], results["skipped"]["shapes"] = _shapes_suite(p, progress)
    if "hf" in p.suites:
        results["hf"], results["skipped"]["hf"] = hf_suite.suite(p, progress, _needs("hf", "transformers is not installed"))
    if "cold" in p.suites:
        results["cold"] = cold.suite(p.quick, progress)
    if "recurrent" in p.suites:
        results["recurrent"], results["skipped"]["recurrent"] = recurrent_suite.suite(p, progress)
    if "hybrid" in p.suites:
        results["hybrid"], results["skipped"]["hybrid"] = hybrid_suite.suite(p, progress)
    if "hybrid-decode" in p.suites:
        results["hybrid_decode"], results["skipped"]["hybrid-decode"] = hybrid_suite.decode_suite(p, progress)
    if "hf-hybrid" in p.suites:
        results["hf_hybrid"], results["skipped"]["hf-hybrid"] = hf_hybrid_suite.suite(
            p, progress, _needs("hf-hybrid", "torch or transformers is not installed"))
    if ring:
        results["ring"], results["ring_pingpong_gb_s"] = ring["rows"], ring["pingpong_gb_s"]
        results["mpi_ranks"] = ring["size"]
        results["skipped"]["ring"] = ring["skipped"]
    if trained:
        results["train_mpi"], results["mpi_ranks"] = trained["rows"], trained["size"]
        results["skipped"]["train-mpi"] = trained["skipped"]
    if mpi:
        mpi["wait"]()  # the other ranks may finish now
    results["skipped"] = {k: v for k, v in results["skipped"].items() if v}
    return results


def _sweep(p: Plan, rng, timed, progress, tick) -> list[dict]:
    sw = p.sizes["sweep"]
    rows = []
    for t in sw["ts"]:
        progress(0, description=f"sweep: T={t}")
        q, k, v, dout = inputs(rng, 1, 1, 1, t, t, sw["d"])
        secs = timed({m: runner(m, q, k, v, dout, causal=False, backward=True) for m in _sweep_methods(p, t)})
        del q, k, v, dout
        rows.append({"t": t, "d": sw["d"], "seconds": secs, "flop": fwd_bwd_flops(1, 1, t, t, sw["d"], False),
                     "peak": {}})
    if p.memory:
        progress(0, description="sweep: peak memory, fresh processes")
        peak = peak_extra(_memory_jobs(p), sw["d"], False, p.threads, side_by_side=p.quick, tick=tick)
        for row in rows:
            row["peak"] = {m: peak[m, row["t"]] for m in _sweep_methods(p, row["t"]) if (m, row["t"]) in peak}
    return rows


def _encoder_suite(p: Plan):
    """``(rows, None)`` from encoder.measure, or ``([], reason)`` when a part is missing."""
    try:
        import sentence_transformers  # noqa: F401
        import torch  # noqa: F401

        from qkv.models import default_model_path
        default_model_path()
    except Exception as err:  # a missing extra or model: say so in the report, run the rest
        return [], _needs("encoder", f"{type(err).__name__}: {err}")
    from .encoder import measure
    return measure(p.repeats, n_short=16 if p.quick else 256, n_long=2 if p.quick else 16), None


def _needs(suite: str, why: str) -> str:
    """Why ``suite`` was skipped, and the extra that brings what it lacks."""
    return f"{why} (it needs: pip install -e '.[{EXTRAS[suite]}]')"


def _against_torch(p: Plan, progress, suite: str, measure):
    """``(rows, None)`` from ``measure(told)``, or ``([], reason)`` without PyTorch; ``told``
    advances the progress bar as measure says a label before each step."""
    if not p.torch:
        if importlib.util.find_spec("torch") is None:
            return [], _needs(suite, "torch is not installed")
        return [], "PyTorch was left out (torch=False, --no-torch)"
    started = []

    def told(label):  # measure says a label before each step: the step before it is done
        progress(1 if started else 0, description=f"{suite}: {label}")
        started.append(label)
    rows = measure(told)
    progress(1)
    return rows, None


def _torch_suite(p: Plan, progress):
    """torch_suite.measure's rows (see :func:`_against_torch`)."""
    return _against_torch(p, progress, "torch", lambda told: torch_suite.measure(
        p.repeats, p.quick, told, memory=_torch_memory(p), threads=p.threads))


def _shapes_suite(p: Plan, progress):
    """shapes_suite.measure's rows (see :func:`_against_torch`)."""
    return _against_torch(p, progress, "shapes", lambda told: shapes_suite.measure(p.repeats, p.quick, told))


def _ring_suite(p: Plan, progress) -> dict:
    """Every rank: ring.suite's rows (rank 0) and this rank's ``wait`` (the end of the run), or
    the reason it was skipped (no mpi4py)."""
    try:
        from mpi4py import MPI
    except ImportError as err:
        return dict(rank=0, size=None, rows=[], pingpong_gb_s=None, skipped=_needs("ring", f"{type(err).__name__}: {err}"),
                    wait=lambda: None)
    from . import ring

    comm = MPI.COMM_WORLD
    rows, gbs = ring.suite(comm, p.sizes["ring"], p.repeats, RING_LAYOUTS, progress)
    return dict(rank=comm.Get_rank(), size=comm.Get_size(), rows=rows or [], pingpong_gb_s=gbs, skipped=None,
                wait=lambda: ring.idle_wait(comm))


def _train_mpi_suite(p: Plan, progress) -> dict:
    """Every rank: train_mpi.suite's rows (rank 0) and this rank's ``wait``, as :func:`_ring_suite`."""
    try:
        from mpi4py import MPI
    except ImportError as err:
        return dict(rank=0, size=None, rows=[], skipped=_needs("train-mpi", f"{type(err).__name__}: {err}"),
                    wait=lambda: None)
    from . import ring

    comm = MPI.COMM_WORLD
    rows = train_mpi.suite(comm, p.sizes["train-mpi"], p.repeats, progress)
    return dict(rank=comm.Get_rank(), size=comm.Get_size(), rows=rows or [], skipped=None,
                wait=lambda: ring.idle_wait(comm))
