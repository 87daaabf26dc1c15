"""The delta rule's compiled float32 backward (qkv.recurrent.delta.compiled: backward_states, then
backward_chunks) against the float64 step oracle, each gradient within a budget of the NumPy
path's own float32 error: T a multiple of the chunk (the gradients written in place) and not,
one head group and one a head (each group writing its heads of the gradients), with and without
a decay, an initial state and dstate."""
import numpy as np
import pytest

from qkv import jit
from qkv.recurrent.delta import chunk as delta, naive as recurrence

BUDGET = 4.0   # x the NumPy float32 path's error against float64 (measured: at most 2.6, these cases and 3 more seeds)


def _compiled_or_skip():
    mod = jit.load(jit.DELTA)
    if mod is None or not mod.SGEMM:
        pytest.skip("numba (the fast extra) with a BLAS sgemm is not available, or QKV_JIT=0")
    return mod


def _inputs(B, H, T, Dk, Dv, gated, state, seed=0):
    rng = np.random.default_rng(seed + T + Dk)
    q, k = rng.standard_normal((B, H, T, Dk)), rng.standard_normal((B, H, T, Dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v, do = rng.standard_normal((B, H, T, Dv)), rng.standard_normal((B, H, T, Dv))
    beta = rng.uniform(0, 1, (B, H, T))
    g = -rng.uniform(0, 1, (B, H, T)) if gated else None
    if gated:
        g[rng.uniform(size=g.shape) < 0.1] = -30.0                 # some steps forget almost everything
    S0, dS = (rng.standard_normal((B, H, Dk, Dv)) if state else None for _ in range(2))
    return q, k, v, beta, g, S0, do, dS


def _rel(x, ref):
    return float(np.abs(np.asarray(x, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-300))


@pytest.mark.parametrize("B, H, T, Dk, Dv, chunk", [(1, 2, 96, 16, 24, 32), (2, 3, 100, 32, 16, None),
                                                    (2, 2, 64, 8, 8, 16), (1, 1, 5, 4, 6, None)])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("state", [True, False], ids=["state", "no-state"])
@pytest.mark.parametrize("groups", ["one", "a head each"])
def test_compiled_backward_within_budget_of_the_numpy_path(monkeypatch, B, H, T, Dk, Dv, chunk, gated, state,
                                                           groups):
    mod = _compiled_or_skip()
    q, k, v, beta, g, S0, do, dS = _inputs(B, H, T, Dk, Dv, gated, state)
    want = recurrence.delta_backward(do, dS, q, k, v, beta, g, scale=0.7, initial_state=S0)
    x32 = [None if x is None else x.astype(np.float32) for x in (do, dS, q, k, v, beta, g)]
    if groups != "one":
        monkeypatch.setattr(delta, "GROUP_WORK", 1)                # every (batch, head) pair its own group
    calls = []
    real = mod.backward_chunks
    monkeypatch.setattr(mod, "backward_chunks", lambda *a: calls.append(1) or real(*a))
    S0_32 = None if S0 is None else S0.astype(np.float32)
    got = delta.backward(*x32, scale=0.7, initial_state=S0_32, chunk=chunk)
    assert len(calls) == (1 if groups == "one" else B * H), "the compiled backward did not run"
    monkeypatch.setitem(jit._loaded, jit.DELTA, None)
    plain = delta.backward(*x32, scale=0.7, initial_state=S0_32, chunk=chunk)
    for name, a, b, w in zip(["dq", "dk", "dv", "dbeta", "dg", "dS0"], got, plain, want):
        if (name == "dg" and not gated) or (name == "dS0" and not state):
            assert a is None and b is None, name
            continue
        assert a.dtype == np.float32 and a.shape == w.shape and np.all(np.isfinite(a)), name
        budget = BUDGET * max(_rel(b, w), np.finfo(np.float32).eps)
        assert _rel(a, w) <= budget, f"{name}: {_rel(a, w):.2e} > {budget:.2e} (NumPy path {_rel(b, w):.2e})"
