"""One differential harness for every entry point: seeded problems (tests/problems.py)
against the float64 oracle written from the README's definitions (tests/oracle.py).

Entry points: every kernel through the kernel interface at float32 scores up to 1e30
(``differential.judge_kernels``) and with a NaN or inf in k or v at a key some rows may not
see (``differential.judge_hidden``), ``qkv.attention`` (methods "reference" and "flash"; out with lse and weights,
and out alone), ``qkv.attention_backward`` (both methods), ``qkv.torch.attention`` (forward,
and autograd through out and lse), ``qkv.nn.MultiHeadAttention`` (self and cross, GQA/MQA,
RoPE, ALiBi, biases, lengths) and ``qkv.nn.SelfAttention``, and under ``mpiexec -n 2`` and
``-n 3`` ``qkv.distributed.ring_attention``/``ring_attention_backward`` and
``RingMultiHeadAttention`` (tests/mpi_differential.py). The budget is the judge's
(tests/differential.py): float64 to 1e-10 of the result's size, float32 within twice the
error of plain float32 dense math.

A short run by default (a few seconds per family); ``QKV_DIFFERENTIAL=N`` runs N cases per
family (``QKV_DIFFERENTIAL_SEED=S`` draws another run). The number of cases run is printed
in pytest's summary. A failure lists every failing case with its seed, index and options:
``problems.make_case(seed, index, kind)`` rebuilds it (tests/ on sys.path).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import qkv
import oracle
from differential import (attempt, build_mha, extreme_problem, hidden_key_problem, judge, judge_hidden, judge_kernels,
                          judge_layer, judge_mha, plain)
from problems import cases
from helpers import mpiexec

HERE = Path(__file__).parent
LONG = int(os.environ.get("QKV_DIFFERENTIAL", "0") or 0)
SEED = int(os.environ.get("QKV_DIFFERENTIAL_SEED", "0") or 0)
SHORT = {"core": 160, "torch": 80, "mha": 50, "self": 30, "ring": 14, "ring_layer": 6}
SHOWN = 25   # failing cases spelled out in one test's message


def n_cases(kind: str) -> int:
    return LONG or SHORT[kind]


def finish(kind: str, results: list, counts: dict) -> None:
    """Record how many cases ran; fail with every failing case (seed, index, options, why)."""
    counts[kind] = counts.get(kind, 0) + len(results)
    bad = [(case, fails) for case, fails in results if fails]
    if bad:
        lines = [f"{len(bad)} of {len(results)} {kind} cases fail (seed {SEED}):"]
        for case, fails in bad[:SHOWN]:
            lines.append(f"- {case}\n      " + "\n      ".join(fails))
        if len(bad) > SHOWN:
            lines.append(f"... and {len(bad) - SHOWN} more")
        pytest.fail("\n".join(lines), pytrace=False)


# ----------------------------------------------------------------------------- qkv.attention
def check_core(case) -> list:
    a, opts = case.arrays, case.opts
    q, k, v, dout = a["q"], a["k"], a["v"], a["dout"]
    want = oracle.solve(q, k, v, dout, **opts)
    base = None if q.dtype == np.float64 else plain(oracle.solve(q, k, v, dout, dtype=np.float32, **opts), q.dtype)
    lse_dt = np.float64 if q.dtype == np.float64 else np.float32
    pick = (lambda name: None if base is None else getattr(base, name))
    fails: list = []
    weights = case.index % 2 == 0
    for method in ("reference", "flash"):
        what = f"attention(method={method!r}, return_lse=True, return_weights={weights})"
        res, ok = attempt(case, what, lambda: qkv.attention(q, k, v, return_lse=True, return_weights=weights,
                                                             method=method, **opts), fails)
        if ok:
            if not isinstance(res, tuple) or len(res) != 2 + weights:
                fails.append(f"{what}: returned {type(res).__name__} of {len(res) if isinstance(res, tuple) else 1}")
                continue
            out, lse = res[:2]
            fails += [judge(f"{method} out", out, want.out, want.size["out"], pick("out"), q.dtype),
                      judge(f"{method} lse", lse, want.lse, want.size["lse"], pick("lse"), lse_dt)]
            if weights:
                fails.append(judge(f"{method} weights", res[2], want.weights, want.size["weights"], pick("weights"),
                                   q.dtype))
        alone, ok_alone = attempt(case, f"attention(method={method!r})",
                                  lambda: qkv.attention(q, k, v, method=method, **opts), fails)
        if ok_alone:
            fails.append(judge(f"{method} out (alone)", alone, want.out, want.size["out"], pick("out"), q.dtype))
        if not ok:
            continue
        grads, ok = attempt(case, f"attention_backward(method={method!r})",
                            lambda: qkv.attention_backward(dout, q, k, v, out, lse, method=method, **opts), fails)
        if ok:
            for name, got in zip(("dq", "dk", "dv"), grads):
                fails.append(judge(f"{method} {name}", got, getattr(want, name), want.size[name], pick(name), q.dtype))
    return [f for f in fails if f]


def test_attention_and_backward(differential_counts):
    """qkv.attention and qkv.attention_backward, both methods, against the oracle."""
    finish("core", [(case, check_core(case)) for case in cases(SEED, n_cases("core"), "core")], differential_counts)


# ----------------------------------------------------------------------------- qkv.torch
def check_torch(case, torch) -> list:
    import qkv.torch as qt

    a, opts = case.arrays, case.opts
    q, k, v, dout = a["q"], a["k"], a["v"], a["dout"]
    lse_dt = np.float64 if q.dtype == np.float64 else np.float32
    dlse = np.random.default_rng([case.seed, case.index, 99]).standard_normal(dout.shape[:-1]).astype(lse_dt)
    want = oracle.solve(q, k, v, dout, dlse=dlse, **opts)
    base = None if q.dtype == np.float64 else oracle.solve(q, k, v, dout, dlse=dlse, dtype=np.float32, **opts)
    pick = (lambda name: None if base is None else getattr(base, name))
    tq, tk, tv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))

    def run():
        out, lse = qt.attention(tq, tk, tv, return_lse=True, method=case.extra["method"], **opts)
        torch.autograd.backward([out, lse], [torch.from_numpy(dout), torch.from_numpy(dlse)])
        grads = [None if t.grad is None else t.grad.numpy() for t in (tq, tk, tv)]
        return [out.detach().numpy(), lse.detach().numpy()] + grads

    fails: list = []
    res, ok = attempt(case, "qkv.torch.attention + autograd", run, fails)
    if ok:
        for name, got, dt in zip(("out", "lse", "dq", "dk", "dv"), res, (q.dtype, lse_dt) + (q.dtype,) * 3):
            fails.append(judge(f"torch {name}", got, getattr(want, name), want.size[name], pick(name), dt))
    return [f for f in fails if f]


def test_torch_adapter(differential_counts):
    """qkv.torch.attention: forward, and gradients by autograd through out and lse."""
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    finish("torch", [(case, check_torch(case, torch)) for case in cases(SEED, n_cases("torch"), "torch")],
           differential_counts)


# ----------------------------------------------------------------------------- qkv.nn
def check_mha(case) -> list:
    fails: list = []
    layer, ok = attempt(case, "MultiHeadAttention(...)", lambda: build_mha(case, qkv.nn.MultiHeadAttention), fails)
    if not ok:
        return fails
    a = case.arrays

    def run():
        y = layer.forward(a["x"], a["context"], **case.opts)
        back = layer.backward(a["dy"])
        dx, dctx = back if isinstance(back, tuple) else (back, None)
        return dict(y=y, dx=dx, dcontext=dctx, **{f"d{n}": np.array(g) for n, g in layer.grads.items()})

    got, ok = attempt(case, "MultiHeadAttention forward/backward", run, fails)
    if ok:
        fails += judge_mha(case, got, {n: np.array(p) for n, p in layer.params.items()})
    return fails


def check_self(case) -> list:
    e, a = case.extra, case.arrays
    fails: list = []

    def run():
        layer = qkv.nn.SelfAttention(e["d_model"], e["d_k"], d_v=e["d_v"], causal=e["causal"], dtype=e["dtype"],
                                     rng=np.random.default_rng(e["seed"]))
        y = layer.forward(a["x"])
        dx = layer.backward(a["dy"])
        return layer, dict(y=y, dx=dx, **{f"d{n}": np.array(g) for n, g in layer.grads.items()})

    res, ok = attempt(case, "SelfAttention forward/backward", run, fails)
    if not ok:
        return fails
    layer, got = res
    params = {n: np.array(p) for n, p in layer.params.items()}
    ldt = np.dtype(e["dtype"])
    x, dy = a["x"].astype(ldt), a["dy"].astype(ldt)
    want = oracle.self_attention(params, x, dy, causal=e["causal"])
    base = oracle.self_attention(params, x, dy, causal=e["causal"], dtype=np.float32) if ldt != np.float64 else None
    fails += judge_layer(got, want, base, ldt)
    return [f for f in fails if f]


def test_multihead_layer(differential_counts):
    """qkv.nn.MultiHeadAttention forward and backward (every gradient) against the oracle
    applied to its own parameters."""
    finish("mha", [(case, check_mha(case)) for case in cases(SEED, n_cases("mha"), "mha")], differential_counts)


def test_self_attention_layer(differential_counts):
    finish("self", [(case, check_self(case)) for case in cases(SEED, n_cases("self"), "self")], differential_counts)


# ----------------------------------------------------------------------------- under mpiexec
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_ring_under_mpiexec(world, differential_counts):
    """ring_attention, ring_attention_backward and RingMultiHeadAttention on W ranks against
    the oracle on the whole arrays (tests/mpi_differential.py; rank 0 judges)."""
    n_ring, n_layer = n_cases("ring"), n_cases("ring_layer")
    res = mpiexec(world, "-m", "mpi4py", str(HERE.parent / "mpi_differential.py"), str(SEED), str(n_ring), str(n_layer),
                  timeout=120 + 6 * (n_ring + n_layer))
    summary = [line for line in res.stdout.splitlines() if line.startswith("differential ")]
    differential_counts[f"ring W={world}"] = n_ring
    differential_counts[f"ring layer W={world}"] = n_layer
    failing = [block.split("\ndifferential ")[0] for block in ("\n" + res.stdout).split("\nFAIL ")[1:]]
    shown = "\n".join("- " + block for block in failing[:SHOWN])
    if res.returncode != 0 or not summary:
        pytest.fail(f"mpiexec -n {world} ended with status {res.returncode} before its summary; the cases that "
                    f"failed before that:\n{shown}\n--- stdout tail:\n{res.stdout[-3000:]}\n--- stderr tail:\n"
                    f"{res.stderr[-3000:]}", pytrace=False)
    if failing:
        pytest.fail(f"{summary[0]} (seed {SEED}; QKV_DIFFERENTIAL_CASES=ring:I,ring_layer:J runs the worker on "
                    f"those alone):\n{shown}", pytrace=False)


# ----------------------------------------------------------------------------- the oracle
def test_the_oracle_draws_the_readmes_pictures():
    """The oracle's rules against the 0/1 matrices the README and the docstring draw."""
    def pic(tq, tk, **opts):
        return oracle.allowed((1,), tq, tk, **opts)[0].astype(int).tolist()

    assert pic(2, 5, causal=True) == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    assert pic(2, 5, causal=True, align="bottom_right") == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert pic(2, 5, causal="bottom_right") == pic(2, 5, causal=True, align="bottom_right")
    assert pic(2, 5, window=(1, 1), align="bottom_right") == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert pic(2, 5, causal=True, align="bottom_right", kv_lengths=[3]) == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert pic(6, 6, causal=True, chunk=3) == np.kron(np.eye(2, dtype=int), np.tril(np.ones((3, 3), int))).tolist()
    assert pic(3, 3, window=(None, 2 ** 64)) == [[1] * 3] * 3               # Python ints: no overflow
    assert pic(3, 3, causal=True, chunk=10 ** 30) == np.tril(np.ones((3, 3), int)).tolist()
    # ALiBi -slope·|i' - j| at the aligned position; a row of -1e30 (HF's mask value) is not
    # masked: float64 itself loses the scores there, so its weights are uniform
    add = oracle.additive((1, 1), 2, 4, align="bottom_right", alibi=[0.5])[0, 0]
    assert add.tolist() == [[-1.0, -0.5, 0.0, -0.5], [-1.5, -1.0, -0.5, 0.0]]
    q = np.float32([[[[1.0, 2.0]]]])
    kv = np.float32([[[[1.0, 0.0], [3.0, 1.0], [-2.0, 5.0]]]])
    out, lse, w = oracle.attention(q, kv, kv, bias=np.full((1, 3), -1e30))
    assert w.tolist() == [[[[1 / 3, 1 / 3, 1 / 3]]]] and lse[0, 0, 0] == -1e30
    out, lse, w = oracle.attention(q, kv, kv, bias=np.float64([[-np.inf] * 3]))
    assert (out == 0).all() and lse[0, 0, 0] == -np.inf and (w == 0).all()


# ----------------------------------------------------------------------------- the draw
def test_the_draw_reaches_what_it_promises():
    """The generator holds what tests/problems.py says: magnitudes, HF mask values beside
    float32 inputs, rows that see nothing, NaN padding, every option, extremes, odd shapes."""
    n = max(n_cases("core"), 160)
    seen: dict = {}

    def saw(key, flag=True):
        seen[key] = seen.get(key, 0) + bool(flag)

    for case in cases(SEED, n, "core"):
        q, k, opts = case.arrays["q"], case.arrays["k"], case.opts
        saw(f"dtype {q.dtype}")
        saw(f"ndim {q.ndim}")
        saw("T=1", q.shape[-2] == 1 or k.shape[-2] == 1)
        saw("Tq!=Tk", q.shape[-2] != k.shape[-2])
        saw("gqa", opts.get("gqa") and q.shape[-3] != k.shape[-3])
        saw("mqa", opts.get("gqa") and k.shape[-3] == 1 and q.shape[-3] > 1)
        saw("scale>5", abs(opts.get("scale", 0)) > 5)
        saw("score std>10", any(t.startswith("score std") and float(t.split()[-1]) > 10 for t in case.tags))
        bias = opts.get("bias")
        saw("f64 bias -1e30 row beside f32", bias is not None and bias.dtype == np.float64 and q.dtype == np.float32
            and "a bias row of -1e30" in case.tags)
        saw("-1e38", bias is not None and (bias == -1e38).any())
        saw("empty row", np.isneginf(oracle.solve(q, k, case.arrays["v"], **opts).lse).any())
        saw("NaN padding", np.isnan(k).any())
        for name in ("mask", "bias", "causal", "align", "window", "chunk", "kv_lengths", "q_lengths", "alibi"):
            saw(name, name in opts)
        saw("extreme", case.refusable or any(t.startswith(("window_", "chunk_", "alibi_")) for t in case.tags))
    missing = [key for key in ("dtype float16", "dtype float32", "dtype float64", "ndim 2", "ndim 3", "ndim 4", "T=1",
                               "Tq!=Tk", "gqa", "mqa", "scale>5", "score std>10", "f64 bias -1e30 row beside f32",
                               "-1e38", "empty row", "NaN padding", "mask", "bias", "causal", "align", "window",
                               "chunk", "kv_lengths", "q_lengths", "alibi", "extreme") if not seen.get(key)]
    assert not missing, (missing, seen)


# ----------------------------------------------------------------------------- every kernel, extreme scores
@pytest.mark.slow
def test_every_kernel_at_extreme_magnitudes(differential_counts):
    """Issue 34: every kernel (reference, flash, stacked, the row kernel and its NumPy form,
    each where it applies) at float32 scores of std 1e3 to 1e30, forward and backward, lse and
    dlse, masks, softcap, dropout, each backward also from the reference's and the tiled
    kernel's out and lse: the float64 oracle's answer within the float32 budget, never a NaN.
    (The row kernel gave NaN rows from ~1e9 on; the backwards that read lse, NaN or 0 from
    an lse one ulp off.) ``differential.extreme_problem(seed,
    index)`` rebuilds a case."""
    n = LONG or 60
    bad = []
    for i in range(n):
        q, k, v, dout, dlse, opts, what = extreme_problem(SEED, i)
        fails = judge_kernels(q, k, v, dout, dlse, **opts)
        for other in ("reference", "flash"):            # another kernel's lse: an ulp is 256 at 4e9
            fails += [f"(from {other}'s lse) {f}" for f in judge_kernels(q, k, v, dout, dlse, lse_from=other, **opts)]
        if fails:
            bad.append(f"- extreme_problem({SEED}, {i}): {what}\n      " + "\n      ".join(fails))
    differential_counts["extreme"] = n
    if bad:
        pytest.fail(f"{len(bad)} of {n} extreme-magnitude problems fail:\n" + "\n".join(bad[:SHOWN]), pytrace=False)


@pytest.mark.parametrize("method", ["auto", "reference", "flash"])
def test_float16_inputs_at_large_scores(method):
    """float16 q, k up to ~3e4 (scores to ~1e9, computed in float32) through qkv.attention and
    attention_backward: the oracle's answer within the budget, never a NaN."""
    rng = np.random.default_rng(34)
    for std in (1e2, 3e3, 3e4):
        q, k = ((rng.standard_normal((2, 2, 40, 16)) * std).clip(-6e4, 6e4).astype(np.float16) for _ in range(2))
        v, dout = (rng.standard_normal((2, 2, 40, 16)).astype(np.float16) for _ in range(2))
        for opts in (dict(), dict(causal=True)):
            want = oracle.solve(q, k, v, dout, **opts)
            base = plain(oracle.solve(q, k, v, dout, dtype=np.float32, **opts), np.float16)
            out, lse = qkv.attention(q, k, v, return_lse=True, method=method, **opts)
            grads = qkv.attention_backward(dout, q, k, v, out, lse, method=method, **opts)
            fails = [judge("out", out, want.out, want.size["out"], base.out, np.float16),
                     judge("lse", lse, want.lse, want.size["lse"], base.lse, np.float32)]
            fails += [judge(n, g, getattr(want, n), want.size[n], getattr(base, n), np.float16)
                      for n, g in zip(("dq", "dk", "dv"), grads)]
            assert [f for f in fails if f] == [], (std, opts)


# ----------------------------------------------------------------------------- every kernel, hidden keys
def test_a_hidden_key_never_reaches_a_row_on_any_kernel(differential_counts):
    """Issue 34: a NaN or inf in k or v at a key that some rows may not see (causal, window,
    chunk, mask, a -inf bias; softcap and dropout beside) reaches only the rows that may see
    it, on every kernel, forward and backward: elsewhere the oracle's answer with that entry
    0. ``differential.hidden_key_problem(seed, index)`` rebuilds a case."""
    n = LONG or 40
    bad = []
    for i in range(n):
        q, k, v, dout, dlse, opts, poison, what = hidden_key_problem(SEED, i)
        fails = judge_hidden(q, k, v, dout, dlse, opts, poison)
        if fails:
            bad.append(f"- hidden_key_problem({SEED}, {i}): {what}\n      " + "\n      ".join(fails))
    differential_counts["hidden keys"] = n
    if bad:
        pytest.fail(f"{len(bad)} of {n} hidden-key problems fail:\n" + "\n".join(bad[:SHOWN]), pytrace=False)
