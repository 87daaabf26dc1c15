"""Shared by the compiled float32 backwards' tests (test_recurrent_*_compiled.py): each gradient
of the compiled path against the float64 step oracle, within a budget of the NumPy float32 path's
own error, both measured against the gradient's largest true entry."""
import numpy as np
import pytest

from qkv import jit

BUDGET = 4.0   # x the NumPy float32 path's error (measured at most 1.7-2.7 over the files' cases and 3 more seeds)


def compiled_or_skip(name: str):
    """The compiled module ``name`` (a ``qkv.jit`` constant), or a skip saying why it is missing."""
    mod = jit.load(name)
    if mod is None or not mod.SGEMM:
        pytest.skip("numba (the fast extra) with a BLAS sgemm is not available, or QKV_JIT=0")
    return mod


def rel(x, ref) -> float:
    """max |x - ref| over max |ref|."""
    return float(np.abs(np.asarray(x, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-300))


def check_within_budget(names, got, plain, want, absent=()):
    """Each gradient ``got`` (the compiled path) float32, finite, of the oracle's shape, and within
    :data:`BUDGET` times ``plain``'s (the NumPy path's) error against ``want``; the ``absent``
    names None on both paths."""
    for name, a, b, w in zip(names, got, plain, want):
        if name in absent:
            assert a is None and b is None, name
            continue
        assert a.dtype == np.float32 and a.shape == w.shape and np.all(np.isfinite(a)), name
        budget = BUDGET * max(rel(b, w), np.finfo(np.float32).eps)
        assert rel(a, w) <= budget, f"{name}: {rel(a, w):.2e} > {budget:.2e} (NumPy path {rel(b, w):.2e})"


def counted(monkeypatch, mod, attr: str) -> list:
    """A list that grows by one at each call of ``mod.attr`` (the compiled pass ran)."""
    calls, real = [], getattr(mod, attr)
    monkeypatch.setattr(mod, attr, lambda *a: calls.append(1) or real(*a))
    return calls


def decay_cases(test):
    """The decay backward's cases: shapes (T a multiple of the chunk and not, Dk above 64), mild, steep
    (-30 a step), none and mixed decays, with and without states, one unit or one a head."""
    for name, values, *ids in (("B, H, T, Dk, Dv, chunk", [(1, 2, 96, 16, 24, 32), (2, 3, 100, 32, 16, None),
                                                            (1, 2, 130, 72, 40, None), (1, 1, 5, 4, 6, None)]),
                               ("decays", ["mild", "steep", "none", "mixed"]),
                               ("state", [True, False], ["state", "no-state"]), ("units", ["one", "a head each"])):
        test = pytest.mark.parametrize(name, values, ids=ids[0] if ids else None)(test)
    return test


def decay_case(monkeypatch, name: str, inputs, B, H, chunk, units: str) -> None:
    """The decay backward's compiled path (``qkv.jit`` module ``name``) within budget: ``inputs``
    ``(q, k, v, g, S0, dout, dstate)`` float64; one work unit or one a (batch, head) pair."""
    from qkv.recurrent.decay import chunk as decay, naive as recurrence

    mod = compiled_or_skip(name)
    q, k, v, g, S0, do, dS = inputs
    want = recurrence.decay_backward(do, dS, q, k, v, g, scale=0.7, initial_state=S0)
    x32 = [None if x is None else x.astype(np.float32) for x in (do, dS, q, k, v, g)]
    if units != "one":
        monkeypatch.setattr(decay, "UNIT_ROWS", 1)                 # every (batch, head) pair its own unit
    calls = counted(monkeypatch, mod, "backward_chunks")
    S0_32 = None if S0 is None else S0.astype(np.float32)
    got = decay.backward(*x32, scale=0.7, initial_state=S0_32, chunk=chunk)
    assert len(calls) == (1 if units == "one" else B * H), "the compiled backward did not run"
    monkeypatch.setitem(jit._loaded, name, None)
    plain = decay.backward(*x32, scale=0.7, initial_state=S0_32, chunk=chunk)
    check_within_budget(["dq", "dk", "dv", "dg", "dS0"], got, plain, want, absent=() if S0 is not None else ("dS0",))
