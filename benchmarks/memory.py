"""Peak extra memory of one forward+backward, measured in a fresh process.

The number is the resident-set high-water mark of the process during the call minus its
resident set just before it (``/proc/self/clear_refs`` resets the mark after the inputs
exist; where that is not allowed, ``ru_maxrss`` before and after). It counts everything
the call allocates, outputs and gradients included, for NumPy and torch alike.

A full run measures each (method, T) in a process of its own. A quick run measures all
sizes of one method in one process, smallest first, and runs the methods' processes side
by side: a few seconds instead of a dozen process starts (a memory figure does not depend
on what else runs, but memory freed by a smaller size may be reused by a larger one, so a
quick run's figures can read low).
"""
from __future__ import annotations

import json
import subprocess
import sys

_CHILD = """
import json, sys
from qkv_benchmarks.memory import child
print(json.dumps(child(*json.loads(sys.argv[1]))))
"""


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def mark() -> tuple[int, str]:
    """Reset this process's resident-set high-water mark to its present resident set;
    returns ``(KiB resident now, how)`` for :func:`extra_bytes`. Where ``/proc/self/clear_refs``
    cannot be written, the mark is ``ru_maxrss`` (the process's peak so far)."""
    import resource

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current resident set
        return _status_kib("VmRSS"), "VmHWM after clear_refs"
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss"


def extra_bytes(since: tuple[int, str]) -> int:
    """Bytes the resident-set high-water mark rose above the :func:`mark` ``since``."""
    import resource

    before, how = since
    after = _status_kib("VmHWM") if how != "ru_maxrss" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(0, after - before) * 1024


def child(method, ts, d, causal, threads):
    """In a fresh process: ``[{"extra_bytes", "how"}]``, one per T of ``ts`` in order."""
    import numpy as np

    from .attention import inputs, runner
    if method == "torch":
        import torch
        torch.set_num_threads(threads)
    else:
        import qkv
        qkv.set_num_threads(threads)
    rng = np.random.default_rng(0)
    runner(method, *inputs(rng, 1, 1, 1, 64, 64, d), causal=causal, backward=True)()  # load, start threads
    found = []
    for t in ts:
        fn = runner(method, *inputs(rng, 1, 1, 1, t, t, d), causal=causal, backward=True)
        since = mark()
        fn()
        found.append({"extra_bytes": extra_bytes(since), "how": since[1]})
        del fn
    return found


def peak_extra(jobs, d, causal, threads, *, side_by_side=False, tick=None) -> dict:
    """``{(method, t): {"extra_bytes", "how"} or None}`` for ``jobs``, a list of
    ``(method, [t, ...])``, one fresh process each (None where a process failed).

    ``side_by_side`` starts every process at once; else one after the other. ``tick()``
    is called as each process finishes.
    """
    tick = tick or (lambda: None)
    found = {}

    def start(method, ts):
        return subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps([method, list(ts), d, causal, threads])],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def collect(proc, method, ts):
        try:
            out, _ = proc.communicate(timeout=900)
            rows = json.loads(out.strip().splitlines()[-1]) if proc.returncode == 0 else [None] * len(ts)
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            proc.kill()
            proc.communicate()
            rows = [None] * len(ts)
        found.update({(method, t): row for t, row in zip(ts, rows)})
        tick()

    if side_by_side:
        procs = [(start(m, ts), m, ts) for m, ts in jobs]
        for job in procs:
            collect(*job)
    else:
        for m, ts in jobs:
            collect(start(m, ts), m, ts)
    return found
