"""The decay recurrence's compiled float32 backward (qkv.recurrent.decay.compiled: backward_states,
then backward_chunks, driven by qkv.recurrent.decay.fused.backward) against the float64 step oracle,
each gradient within a budget of the NumPy path's own float32 error: a decay a head, mild, steep
(-30 a step), none (g = 0) and mixed; T a multiple of the chunk (the gradients written in place) and
not; one work unit and one a head; with and without an initial state and dstate."""
import numpy as np
import pytest

from qkv import jit
from qkv.recurrent.decay import chunk as decay, naive as recurrence

BUDGET = 4.0   # x the NumPy float32 path's error against float64 (measured: at most 1.7, these cases and 3 more seeds)


def _compiled_or_skip():
    mod = jit.load(jit.DECAY)
    if mod is None or not mod.SGEMM:
        pytest.skip("numba (the fast extra) with a BLAS sgemm is not available, or QKV_JIT=0")
    return mod


def _inputs(B, H, T, Dk, Dv, decays, state, seed=0):
    rng = np.random.default_rng(seed + T + Dk)
    q, k = rng.standard_normal((B, H, T, Dk)), rng.standard_normal((B, H, T, Dk))
    v, do = rng.standard_normal((B, H, T, Dv)), rng.standard_normal((B, H, T, Dv))
    g = {"mild": -rng.uniform(0, 1.5, (B, H, T)), "steep": np.full((B, H, T), -30.0),
         "none": np.zeros((B, H, T)), "mixed": -rng.uniform(0, 1, (B, H, T))}[decays]
    if decays == "mixed":
        g[rng.uniform(size=g.shape) < 0.15] = -30.0                # some steps forget almost everything
        g[rng.uniform(size=g.shape) < 0.15] = 0.0                  # some none
    S0, dS = (rng.standard_normal((B, H, Dk, Dv)) if state else None for _ in range(2))
    return q, k, v, g, S0, do, dS


def _rel(x, ref):
    return float(np.abs(np.asarray(x, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-300))


@pytest.mark.parametrize("B, H, T, Dk, Dv, chunk", [(1, 2, 96, 16, 24, 32), (2, 3, 100, 32, 16, None),
                                                    (1, 2, 130, 72, 40, None), (1, 1, 5, 4, 6, None)])
@pytest.mark.parametrize("decays", ["mild", "steep", "none", "mixed"])
@pytest.mark.parametrize("state", [True, False], ids=["state", "no-state"])
@pytest.mark.parametrize("units", ["one", "a head each"])
def test_compiled_backward_within_budget_of_the_numpy_path(monkeypatch, B, H, T, Dk, Dv, chunk, decays, state,
                                                           units):
    mod = _compiled_or_skip()
    q, k, v, g, S0, do, dS = _inputs(B, H, T, Dk, Dv, decays, state)
    want = recurrence.decay_backward(do, dS, q, k, v, g, scale=0.7, initial_state=S0)
    x32 = [None if x is None else x.astype(np.float32) for x in (do, dS, q, k, v, g)]
    if units != "one":
        monkeypatch.setattr(decay, "UNIT_ROWS", 1)                 # every (batch, head) pair its own unit
    calls = []
    real = mod.backward_chunks
    monkeypatch.setattr(mod, "backward_chunks", lambda *a: calls.append(1) or real(*a))
    S0_32 = None if S0 is None else S0.astype(np.float32)
    got = decay.backward(*x32, scale=0.7, initial_state=S0_32, chunk=chunk)
    assert len(calls) == (1 if units == "one" else B * H), "the compiled backward did not run"
    monkeypatch.setitem(jit._loaded, jit.DECAY, None)
    plain = decay.backward(*x32, scale=0.7, initial_state=S0_32, chunk=chunk)
    for name, a, b, w in zip(["dq", "dk", "dv", "dg", "dS0"], got, plain, want):
        if name == "dS0" and not state:
            assert a is None and b is None, name
            continue
        assert a.dtype == np.float32 and a.shape == w.shape and np.all(np.isfinite(a)), name
        budget = BUDGET * max(_rel(b, w), np.finfo(np.float32).eps)
        assert _rel(a, w) <= budget, f"{name}: {_rel(a, w):.2e} > {budget:.2e} (NumPy path {_rel(b, w):.2e})"


def test_a_decay_a_key_channel_and_float64_do_not_take_the_head_kernel(monkeypatch):
    mod = _compiled_or_skip()
    calls = []
    real = mod.backward_chunks
    monkeypatch.setattr(mod, "backward_chunks", lambda *a: calls.append(1) or real(*a))
    q, k, v, g, S0, do, dS = _inputs(1, 2, 40, 8, 8, "mild", True)
    decay.backward(do, dS, q, k, v, g, scale=0.5, initial_state=S0)
    gc = np.repeat(g[..., None], 8, -1).astype(np.float32)
    f32 = [x.astype(np.float32) for x in (do, dS, q, k, v)]
    decay.backward(*f32, gc, scale=0.5, initial_state=S0.astype(np.float32))
    assert not calls
