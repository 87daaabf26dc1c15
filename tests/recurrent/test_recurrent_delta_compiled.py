"""The delta rule's compiled float32 backward (qkv.recurrent.delta.compiled: backward_states, then
backward_chunks) against the float64 step oracle, each gradient within a budget of the NumPy
path's own float32 error: T a multiple of the chunk (the gradients written in place) and not,
one head group and one a head (each group writing its heads of the gradients), with and without
a decay, an initial state and dstate."""
import numpy as np
import pytest

from compiled_budget import check_within_budget, compiled_or_skip, counted
from qkv import jit
from qkv.recurrent.delta import chunk as delta, naive as recurrence




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



@pytest.mark.parametrize("B, H, T, Dk, Dv, chunk", [(1, 2, 96, 16, 24, 32), (2, 3, 100, 32, 16, None),
                                                    (2, 2, 64, 8, 8, 16), (1, 1, 5, 4, 6, None)])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("state", [True, False], ids=["state", "no-state"])
@pytest.mark.parametrize("groups", ["one", "a head each"])
def test_compiled_backward_within_budget_of_the_numpy_path(monkeypatch, B, H, T, Dk, Dv, chunk, gated, state,
                                                           groups):
    mod = compiled_or_skip(jit.DELTA)
    q, k, v, beta, g, S0, do, dS = _inputs(B, H, T, Dk, Dv, gated, state)
    want = recurrence.delta_backward(do, dS, q, k, v, beta, g, scale=0.7, initial_state=S0)
    x32 = [None if x is None else x.astype(np.float32) for x in (do, dS, q, k, v, beta, g)]
    if groups != "one":
        monkeypatch.setattr(delta, "GROUP_WORK", 1)                # every (batch, head) pair its own group
    calls = counted(monkeypatch, mod, "backward_chunks")
    S0_32 = None if S0 is None else S0.astype(np.float32)
    got = delta.backward(*x32, scale=0.7, initial_state=S0_32, chunk=chunk)
    assert len(calls) == (1 if groups == "one" else B * H), "the compiled backward did not run"
    monkeypatch.setitem(jit._loaded, jit.DELTA, None)
    plain = delta.backward(*x32, scale=0.7, initial_state=S0_32, chunk=chunk)
    check_within_budget(["dq", "dk", "dv", "dbeta", "dg", "dS0"], got, plain, want, absent=(() if gated else ("dg",)) + (() if state else ("dS0",)))


@pytest.mark.parametrize("halves", [True, False], ids=["halves", "whole"])
@pytest.mark.parametrize("B, H, T, Dk, Dv, chunk", [(1, 2, 96, 16, 24, 32), (1, 2, 70, 48, 40, None)])
def test_both_layouts_of_the_state_product_within_budget(monkeypatch, halves, B, H, T, Dk, Dv, chunk):
    """``Y S_0ᵀ`` in two halves against ``Yᵀ`` (where OpenBLAS has small-matrix kernels) or as one product
    (elsewhere): whichever this machine's BLAS picks, the other is tested too."""
    from qkv import threads
    mod = compiled_or_skip(jit.DELTA)
    q, k, v, beta, g, S0, do, dS = _inputs(B, H, T, Dk, Dv, True, True, seed=1)
    want = recurrence.delta_backward(do, dS, q, k, v, beta, g, scale=0.7, initial_state=S0)
    x32 = [x.astype(np.float32) for x in (do, dS, q, k, v, beta, g)]
    monkeypatch.setattr(threads, "small_products", lambda: halves)
    calls = counted(monkeypatch, mod, "backward_chunks")
    got = delta.backward(*x32, scale=0.7, initial_state=S0.astype(np.float32), chunk=chunk)
    assert len(calls) == 1 and calls
    monkeypatch.setitem(jit._loaded, jit.DELTA, None)
    plain = delta.backward(*x32, scale=0.7, initial_state=S0.astype(np.float32), chunk=chunk)
    check_within_budget(["dq", "dk", "dv", "dbeta", "dg", "dS0"], got, plain, want)
