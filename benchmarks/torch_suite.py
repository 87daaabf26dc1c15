"""``qkv bench --suite torch``: ``qkv.torch.attention`` against PyTorch SDPA, in one run.

Three methods on the same float32 inputs (the tensors and the arrays share memory):

- ``qkv.torch``: :func:`qkv.torch.attention` on tensors, backward through autograd;
- ``qkv``: :func:`qkv.attention` / :func:`qkv.attention_backward` on the NumPy views of
  the same tensors (what the wrapper adds is the difference to ``qkv.torch``);
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``, with the pattern as a
  bool mask where SDPA has no option for it, and ``torch.set_num_threads`` equal to qkv's.

Cases (``--quick`` shrinks every size so the run takes seconds):

- ``plain``: B=1, H=8, T=4096, D=64, no mask: the wrapper's cost and the kernel against SDPA;
- ``window``: B=1, H=2, T=8192, D=64, causal with a sliding window of 512 keys
  (``causal=True, window=511``); SDPA gets the equivalent ``(T, T)`` bool mask, made once
  outside the timing;
- ``padding``: B=4, H=8, T=2048, D=64, sequences of T, 3T/4, T/2 and T/4 tokens: qkv gets
  ``kv_lengths``, SDPA the ``(B, 1, 1, T)`` bool key mask.

Each pass (forward; forward+backward) runs the methods in turn with the suite's one timing
loop (``timing.rounds``, the first method rotating from repeat to repeat, after one warm-up
each; a call under a second also runs once untimed right before each timed run, so that it
does not pay for the previous method's still-spinning worker threads); the median time is
reported, and each ratio is the median of the ratios within a repeat (runs that close
together share the machine's load, which matters on a shared machine). FLOP convention for
the plain case: forward ``4·B·H·T²·D``, forward+backward 3.5 times that.

Peak memory (``memory=True``, the default of full runs) is the resident-set high-water mark
of a fresh subprocess during one call minus its resident set just before it
(``memory.mark``, set once the inputs exist and a tiny call of the same method has loaded
its code), so it counts what the call allocates, outputs and gradients included, for NumPy
and torch alike.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys

from .memory import extra_bytes, mark
from .timing import rounds

METHODS = ("qkv.torch", "qkv", "sdpa")
PASSES = ("forward", "forward+backward")
FULL = {
    "plain": dict(b=1, h=8, t=4096, d=64),
    "window": dict(b=1, h=2, t=8192, d=64, window=512),
    "padding": dict(b=4, h=8, t=2048, d=64),
}
QUICK = {
    "plain": dict(b=1, h=2, t=256, d=32),
    "window": dict(b=1, h=2, t=1024, d=32, window=64),
    "padding": dict(b=4, h=2, t=256, d=32),
}
MIB = 2 ** 20
_CHILD = """
import json, sys
from qkv_benchmarks.torch_suite import child_peak
print(json.dumps(child_peak(*json.loads(sys.argv[1]))))
"""


def describe(case: str, size: dict) -> str:
    """``B=1 H=8 T=4096 D=64`` (and the window or the lengths)."""
    text = f"B={size['b']} H={size['h']} T={size['t']} D={size['d']}"
    if case == "window":
        text += f", causal window {size['window']}"
    if case == "padding":
        text += ", lengths T, 3T/4, T/2, T/4"
    return text


def plain_flops(size: dict, pass_: str) -> float:
    """4·B·H·T²·D for a forward, 3.5 times that with the backward."""
    f = 4.0 * size["b"] * size["h"] * size["t"] ** 2 * size["d"]
    return f if pass_ == "forward" else 3.5 * f


def _problem(case: str, size: dict, seed: int = 0):
    """float32 q, k, v, dout and each method's options for one case."""
    import torch

    g = torch.Generator().manual_seed(seed)
    b, h, t, d = size["b"], size["h"], size["t"], size["d"]
    q, k, v, dout = (torch.randn(b, h, t, d, generator=g) for _ in range(4))
    ours, sdpa = {}, {}
    if case == "window":
        i = torch.arange(t)
        w = size["window"]
        ours = dict(causal=True, window=w - 1)  # keys i-w+1 .. i: w keys
        sdpa = dict(attn_mask=(i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w))  # (T, T)
    elif case == "padding":
        lengths = torch.tensor([t * (4 - j) // 4 for j in range(b)])
        ours = dict(kv_lengths=lengths)
        sdpa = dict(attn_mask=(torch.arange(t)[None, :] < lengths[:, None])[:, None, None, :])  # (B, 1, 1, T)
    return q, k, v, dout, ours, sdpa


def runner(method: str, pass_: str, case: str, size: dict):
    """A no-argument callable doing one call of ``method`` (forward, or forward+backward)."""
    import torch

    import qkv
    import qkv.torch as qt

    q, k, v, dout, ours, sdpa = _problem(case, size)
    backward = pass_ != "forward"
    if method == "qkv":
        a = {name: x.numpy() for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout))}
        np_ours = {key: (val.numpy() if isinstance(val, torch.Tensor) else val) for key, val in ours.items()}
        if not backward:
            return lambda: qkv.attention(a["q"], a["k"], a["v"], **np_ours)

        def np_fwd_bwd():
            out, lse = qkv.attention(a["q"], a["k"], a["v"], return_lse=True, **np_ours)
            return qkv.attention_backward(a["dout"], a["q"], a["k"], a["v"], out, lse, **np_ours)
        return np_fwd_bwd

    call = (lambda q, k, v: qt.attention(q, k, v, **ours)) if method == "qkv.torch" else \
        (lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, **sdpa))
    if not backward:
        def fwd():
            with torch.no_grad():
                return call(q, k, v)
        return fwd
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]

    def fwd_bwd():
        out = call(*leaves)
        return torch.autograd.grad(out, leaves, dout)
    return fwd_bwd


def _time(fns: dict, repeats: int) -> dict:
    """Seconds of each run of each callable (``timing.rounds``, the first one rotating)."""
    return {name: [wall for wall, _ in runs] for name, runs in rounds(fns, repeats, rotate=True).items()}


def paired_ratio(times: dict, num: str, den: str) -> float:
    """Median over repeats of ``num``'s time / ``den``'s time in the same repeat: runs that
    close together see the same machine load, which a ratio of two medians does not ensure."""
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


def child_peak(method: str, pass_: str, case: str, size: dict, threads: int) -> float:
    """In a fresh process: MiB the call adds to the resident set at its peak."""
    import torch

    import qkv

    qkv.set_num_threads(threads)
    torch.set_num_threads(threads)
    tiny = dict(size, t=64, d=8, **({"window": 8} if case == "window" else {}))
    runner(method, pass_, case, tiny)()  # load the method's code and thread pools
    fn = runner(method, pass_, case, size)
    since = mark()
    fn()
    return extra_bytes(since) / MIB


def peak_memory(method: str, pass_: str, case: str, size: dict, threads: int | None = None) -> float | None:
    """Peak extra MiB of one call of ``method`` in a fresh subprocess (None where it failed)."""
    import qkv

    args = json.dumps([method, pass_, case, size, threads or qkv.get_num_threads()])
    res = subprocess.run([sys.executable, "-c", _CHILD, args], capture_output=True, text=True)
    if res.returncode != 0:
        return None
    return float(res.stdout.strip().splitlines()[-1])


def measure(repeats: int, quick: bool, progress=None, *, memory: bool | None = None,
            threads: int | None = None) -> list[dict]:
    """Time (and, unless ``memory=False``, peak memory of) every case, pass and method.

    Args:
        repeats: timed runs per method; the median is reported.
        quick: the small sizes of :data:`QUICK` (seconds in all) instead of :data:`FULL`.
        progress: called as ``progress(label)`` before each measurement, if given.
        memory: measure peak memory in subprocesses (default: ``not quick``).
        threads: threads for qkv and torch alike (default ``qkv.get_num_threads()``).

    Returns one dict per case and pass: ``case``, ``pass``, ``shape``, ``seconds`` (medians)
    and ``peak_mib`` (dicts by method; ``peak_mib`` None where not measured), ``gflops``
    (per method, plain case only), ``wrapper`` (qkv.torch time / qkv time: the wrapper's
    cost) and ``vs_sdpa`` (sdpa time / qkv.torch time: above 1, qkv.torch is faster), both
    medians of the ratios within each repeat (:func:`paired_ratio`).
    """
    import torch

    import qkv

    threads = threads or qkv.get_num_threads()
    qkv.set_num_threads(threads)
    torch.set_num_threads(threads)
    memory = (not quick) if memory is None else memory
    sizes = QUICK if quick else FULL
    rows = []
    for case, size in sizes.items():
        for pass_ in PASSES:
            if progress:
                progress(f"{case} {pass_}")
            times = _time({m: runner(m, pass_, case, size) for m in METHODS}, repeats)
            secs = {m: statistics.median(ts) for m, ts in times.items()}
            peaks = None
            if memory:
                if progress:
                    progress(f"{case} {pass_}: peak memory")
                peaks = {m: peak_memory(m, pass_, case, size, threads) for m in METHODS}
            row = dict(case=case, pass_=pass_, shape=describe(case, size), seconds=secs, peak_mib=peaks,
                       wrapper=paired_ratio(times, "qkv.torch", "qkv"), vs_sdpa=paired_ratio(times, "sdpa", "qkv.torch"))
            row["pass"] = row.pop("pass_")
            if case == "plain":
                row["gflops"] = {m: plain_flops(size, pass_) / s / 1e9 for m, s in secs.items()}
            rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows of :func:`measure` as a Markdown table (the table ``qkv bench --suite torch`` shows)."""
    from .report import torch_table

    return torch_table(rows).markdown()
