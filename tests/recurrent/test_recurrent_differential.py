"""The recurrences' differential harness: seeded random problems for every op (the decay with
one decay a head and a decay a key channel, the delta rule gated and not, dplr with both
decays, the scan), every pass (the output, the final state, every gradient: dlog_decay,
dbeta, da, db and the initial state's included), awkward sizes and chunks, both dtypes, in
five regimes: mild decays, steep ones (-10 to -30 every step), resets (single steps of -1e4
or the dtype's most negative number among mild ones), huge values (an input scaled by 1e15)
and a NaN or an inf at one step of one input.

The judge: float64 within 1e-10 of each array's largest true entry (the float64 step loop,
each op's ``naive.py``); float32 within :data:`BUDGET32` times the plain float32 step loop's
own error (``naive`` with ``dtype=np.float32``), relative to the same entry, and a floor of a
few float32 ulps; a NaN or an inf at exactly the steps where the step loop has one. A
failure prints the case's seed and regime (``case(seed, index)`` rebuilds it). The default
run draws :data:`CASES` problems; the slow run (``-m slow``) ten times as many."""
from __future__ import annotations

import numpy as np
import pytest

import qkv.recurrent as rec
from qkv.recurrent.decay import naive as decay_naive
from qkv.recurrent.delta import naive as delta_naive
from qkv.recurrent.generalized_delta import naive as dplr_naive
from qkv.recurrent.scan import naive as scan_naive

OPS = ["decay_head", "decay_chan", "delta", "delta_plain", "dplr_head", "dplr_chan", "scan"]
REGIMES = ["mild", "steep", "resets", "huge", "nan"]
BUDGET32 = 5.0      # x the float32 step loop's error (the delta rule's backward measured 4.0)
CASES = 140
SEED = 51


def case(seed: int, index: int) -> dict:
    """One problem, drawn from ``(seed, index)`` alone."""
    rng = np.random.default_rng([seed, index])
    op, regime = OPS[index % len(OPS)], REGIMES[(index // len(OPS)) % len(REGIMES)]
    dtype = np.float64 if rng.random() < 0.5 else np.float32
    B, H = (int(x) for x in rng.integers(1, 3, 2))
    T = int(rng.choice([1, 2, 7, 31, 33, 64, 97, 130]))
    Dk, Dv = int(rng.integers(1, 9)), int(rng.integers(1, 8))
    chunk = rng.choice([None, 1, 3, 16, 64])
    x = {n: rng.standard_normal((B, H, T, Dk)) for n in ("q", "k")}
    x["v"], x["do"] = rng.standard_normal((B, H, T, Dv)), rng.standard_normal((B, H, T, Dv))
    if op.startswith("delta"):
        x["k"] /= np.linalg.norm(x["k"], axis=-1, keepdims=True)
        x["beta"] = rng.uniform(0, 1, (B, H, T))
    if op.startswith("dplr"):                              # RWKV-7's a = -kn, b = kn · beta
        kn = rng.standard_normal((B, H, T, Dk))
        kn /= np.linalg.norm(kn, axis=-1, keepdims=True)
        x["a"], x["b"] = -kn, kn * rng.uniform(0, 1, (B, H, T, 1))
    per_channel = op in ("decay_chan", "dplr_chan")
    gshape = (B, H, T, Dk) if per_channel else (B, H, T)
    if op == "scan":
        W = Dk * Dv
        x = {"x": rng.standard_normal((B, T, W)), "do": rng.standard_normal((B, T, W))}
        gshape = (B, T, W)
    g = -rng.uniform(0, 1, gshape)
    if regime == "steep":
        g = np.full(gshape, -float(rng.choice([10, 20, 30])))
    elif regime == "resets":
        hit = rng.random(gshape) < 0.2
        g[hit] = rng.choice([-30.0, -1e4, float(np.finfo(dtype).min)], size=int(hit.sum()))
    if op != "delta_plain":
        x["g"] = g
    if regime == "huge":                                   # not the delta rule's keys: |k| = 1 keeps it stable
        name = rng.choice([n for n in x if n not in ("g", "beta", "a", "b") and not (n == "k" and op.startswith("delta"))])
        x[name] = x[name] * 1e15
    if regime == "nan":
        name = rng.choice([n for n in x if n not in ("g", "beta")])
        t = int(rng.integers(0, T))
        x[name][(slice(None),) * (1 if op == "scan" else 2) + (t,)] = rng.choice([np.nan, np.inf])
    shape0 = (B, W) if op == "scan" else (B, H, Dk, Dv)
    state = rng.standard_normal(shape0) if rng.random() < 0.5 else None
    dstate = rng.standard_normal(shape0) if rng.random() < 0.5 else None
    return dict(op=op, regime=regime, dtype=dtype, chunk=None if chunk is None else int(chunk), x=x,
                state=state, dstate=dstate, scale=float(rng.uniform(0.2, 1.2)))


def run_qkv(c: dict) -> list:
    """qkv's outputs and gradients for the case, in its dtype: ``[o, S_T, grads...]``."""
    dt, x = c["dtype"], {n: a.astype(c["dtype"]) for n, a in c["x"].items()}
    st = None if c["state"] is None else c["state"].astype(dt)
    ds = None if c["dstate"] is None else c["dstate"].astype(dt)
    op, kw = c["op"], dict(initial_state=st)
    if op == "scan":
        h, hT = rec.linear_scan(x["x"], x["g"], return_state=True, **kw)
        return [h, hT, *rec.linear_scan_backward(x["do"], x["x"], x["g"], dstate=ds, **kw)]
    kw.update(scale=c["scale"], chunk_size=c["chunk"])
    fwd, bwd, args = {
        "decay": (rec.decay_attention, rec.decay_attention_backward, ("q", "k", "v", "g")),
        "delta": (rec.delta_rule, rec.delta_rule_backward, ("q", "k", "v", "beta", "g")),
        "dplr": (rec.dplr, rec.dplr_backward, ("q", "k", "v", "a", "b", "g")),
    }[op.split("_")[0]]
    a = [x.get(n) for n in args]
    o, S = fwd(*a, return_state=True, **kw)
    return [o, S, *bwd(x["do"], *a, dstate=ds, **kw)]


def run_steps(c: dict, dtype) -> list:
    """The step loop's outputs and gradients in ``dtype`` (float64: the oracle)."""
    x, op, st, ds = c["x"], c["op"], c["state"], c["dstate"]
    extra = {} if dtype == np.float64 else {"dtype": dtype}
    if dtype != np.float64:
        x = {n: a.astype(dtype) for n, a in x.items()}
        st = None if st is None else st.astype(dtype)
        ds = None if ds is None else ds.astype(dtype)
    with np.errstate(all="ignore"):
        if op == "scan":
            h, hT = scan_naive.scan_forward(x["x"], x["g"], initial_state=st, **extra)
            return [h, hT, *scan_naive.scan_backward(x["do"], ds, x["x"], x["g"], initial_state=st, **extra)]
        mod, args = {"decay": (decay_naive, ("q", "k", "v", "g")), "delta": (delta_naive, ("q", "k", "v", "beta", "g")),
                     "dplr": (dplr_naive, ("q", "k", "v", "a", "b", "g"))}[op.split("_")[0]]
        name = {"decay": "decay", "delta": "delta", "dplr": "dplr"}[op.split("_")[0]]
        a = [x.get(n) for n in args]
        o, S = getattr(mod, f"{name}_forward")(*a, scale=c["scale"], initial_state=st, **extra)
        grads = getattr(mod, f"{name}_backward")(x["do"], ds, *a, scale=c["scale"], initial_state=st, **extra)
    return [o, S, *grads]


def steps_hit(a) -> list:
    a = np.asarray(a)
    if a.ndim < 3:
        return [bool(np.isfinite(a).all())]
    axis = 1 if a.ndim == 3 else 2
    return np.flatnonzero(~np.isfinite(np.moveaxis(a, axis, 0).reshape(a.shape[axis], -1)).all(1)).tolist()


def rel(a, ref) -> float:
    top = float(np.abs(ref).max()) if ref.size else 0.0
    err = float(np.abs(np.asarray(a, np.float64) - ref).max()) if ref.size else 0.0
    return err / top if top > 0 else err


def judge(c: dict) -> list:
    """The reasons this case fails (empty: it passes)."""
    got, want = run_qkv(c), run_steps(c, np.float64)
    names = ["o", "S_T"] + [f"grad{i}" for i in range(len(want) - 2)]
    fails = []
    own = None
    for i, (name, a, w) in enumerate(zip(names, got, want)):
        if i == len(want) - 1 and c["state"] is None:   # no initial state: qkv gives no gradient for it
            if a is not None:
                fails.append(f"{name}: a gradient for an initial state not given")
            continue
        if w is None or a is None:
            if (w is None) != (a is None):
                fails.append(f"{name}: None on one side only")
            continue
        if np.asarray(a).dtype != c["dtype"] and c["dtype"] == np.float64:
            fails.append(f"{name}: dtype {np.asarray(a).dtype}")
        if c["regime"] == "nan":
            if steps_hit(a) != steps_hit(w):
                fails.append(f"{name}: non-finite at steps {steps_hit(a)}, the step loop at {steps_hit(w)}")
            continue
        if not np.isfinite(a).all():
            fails.append(f"{name}: not finite")
            continue
        err = rel(a, np.asarray(w, np.float64))
        if c["dtype"] == np.float64:
            budget = 1e-10
        else:
            own = own or run_steps(c, np.float32)
            budget = BUDGET32 * max(rel(own[i], np.asarray(w, np.float64)), 4 * np.finfo(np.float32).eps)
        if err > budget:
            fails.append(f"{name}: {err:.2e} > {budget:.2e}")
    return fails


def _run(n: int, seed: int):
    failures = []
    for index in range(n):
        c = case(seed, index)
        reasons = judge(c)
        if reasons:
            failures.append(f"case({seed}, {index}) {c['op']} {c['regime']} {np.dtype(c['dtype']).name} "
                            f"chunk={c['chunk']}: " + "; ".join(reasons))
    assert not failures, f"{len(failures)} of {n} cases failed:\n" + "\n".join(failures[:30])


def test_every_recurrence_and_pass_against_the_step_loops():
    _run(CASES, SEED)


@pytest.mark.slow
def test_every_recurrence_and_pass_against_the_step_loops_long():
    _run(10 * CASES, SEED + 1)
