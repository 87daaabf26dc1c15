"""The delta rule with grouped value heads (fla's layout: q and k with H heads, v, beta, the
decays and the states with HV = G·H; value head j reads key head j // G): the bits of the
same call with q and k repeated to HV heads, forward and backward (dq, dk summed over each
group), on every path (compiled and NumPy, chunked and step by step, any thread count), and
the checks that name a v whose heads do not group."""
import numpy as np
import pytest

import qkv.recurrent as rec
from qkv import jit, threads
from qkv.errors import ShapeError


def _inputs(B, H, G, T, Dk, Dv, decay, dtype, seed=0, state=True):
    rng = np.random.default_rng(seed)
    HV = H * G
    q = 30 * rng.standard_normal((B, H, T, Dk))                    # q·k scores past ±30
    k = rng.standard_normal((B, H, T, Dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, HV, T, Dv))
    beta = rng.uniform(0, 1, (B, HV, T))
    g = {"none": None, "head": -30 * rng.random((B, HV, T)) ** 3,   # down to -30 a step
         "channel": -5 * rng.random((B, HV, T, Dk)) ** 3}[decay]
    S0 = rng.standard_normal((B, HV, Dk, Dv)) if state else None
    do, dS = rng.standard_normal((B, HV, T, Dv)), rng.standard_normal((B, HV, Dk, Dv))
    cast = lambda x: None if x is None else x.astype(dtype)  # noqa: E731
    return [cast(x) for x in (q, k, v, beta, g, S0, do, dS)]


def _both(q, k, v, beta, g, S0, do, dS, G, chunk):
    """The grouped call and the repeated one: ``(outputs, grads)`` of each."""
    runs = []
    for qq, kk in ((q, k), (np.repeat(q, G, axis=1), np.repeat(k, G, axis=1))):
        o, S = rec.delta_rule(qq, kk, v, beta, g, scale=0.3, initial_state=S0, return_state=True, chunk_size=chunk)
        grads = rec.delta_rule_backward(do, qq, kk, v, beta, g, scale=0.3, initial_state=S0, dstate=dS,
                                        chunk_size=chunk)
        runs.append(((o, S), grads))
    return runs


def _same(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, what
    assert got.tobytes() == want.tobytes(), f"{what}: not the same bits"


def _group_sum(x, H, G):
    return x.reshape(x.shape[:1] + (H, G) + x.shape[2:]).sum(axis=2)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("decay", ["head", "none", "channel"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("B, H, G, T, Dk, Dv, chunk", [(2, 2, 2, 150, 16, 24, None), (1, 3, 3, 70, 8, 5, 16),
                                                       (1, 1, 4, 33, 4, 6, 1)])
def test_grouped_value_heads_give_the_bits_of_repeated_q_and_k(monkeypatch, compiled, decay, dtype,
                                                               B, H, G, T, Dk, Dv, chunk):
    if compiled and not jit.enabled():
        pytest.skip("numba (the fast extra) is not installed, or QKV_JIT=0")
    if not compiled:
        monkeypatch.setattr(jit, "load", lambda name: None)
    q, k, v, beta, g, S0, do, dS = _inputs(B, H, G, T, Dk, Dv, decay, dtype)
    (out, grads), (out_r, grads_r) = _both(q, k, v, beta, g, S0, do, dS, G, chunk)
    for name, a, b in zip(("o", "S_T"), out, out_r):
        assert np.all(np.isfinite(a)), name
        _same(a, b, name)
    assert grads[0].shape == q.shape and grads[1].shape == k.shape
    _same(grads[0], _group_sum(grads_r[0], H, G), "dq")
    _same(grads[1], _group_sum(grads_r[1], H, G), "dk")
    for name, a, b in zip(("dv", "dbeta", "dg", "dS0"), grads[2:], grads_r[2:]):
        if b is None:
            assert a is None and name == "dg"
            continue
        _same(a, b, name)


def test_grouped_heads_on_any_thread_count_and_with_a_nan():
    """Groups of key heads split over threads (or, fewer key heads than threads, the value
    heads): the same bits; a NaN in one k runs the steps one at a time, as the repeated call."""
    q, k, v, beta, g, S0, do, dS = _inputs(1, 3, 2, 700, 40, 24, "head", np.float32, seed=4)
    runs = []
    for n in (1, 2, 3, 4):
        with threads.kernel_threads(n):
            runs.append(rec.delta_rule(q, k, v, beta, g, initial_state=S0, return_state=True))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            _same(a, b, "o, S_T across thread counts")
    k = k.copy()
    k[0, 1, 300, 3] = np.nan
    o, S = rec.delta_rule(q, k, v, beta, g, initial_state=S0, return_state=True)
    o_r, S_r = rec.delta_rule(np.repeat(q, 2, axis=1), np.repeat(k, 2, axis=1), v, beta, g, initial_state=S0,
                              return_state=True)
    _same(o, o_r, "o with a NaN")
    _same(S, S_r, "S_T with a NaN")
    assert np.isnan(o[0, 2:4, 300:]).all() and np.isfinite(o[0, :2]).all() and np.isfinite(o[0, 2:4, :300]).all()


def test_heads_that_do_not_group_are_refused_by_name():
    q, k, v, beta, g, S0, do, dS = _inputs(1, 2, 3, 10, 4, 5, "head", np.float64)
    with pytest.raises(ShapeError, match=r"v must have shape \(B, H, T, Dv\) = \(1, 2, 10, Dv\) or HV value heads, "
                                         r"a multiple of H .*; got \(1, 5, 10, 5\)"):
        rec.delta_rule(q, k, v[:, :5], beta[:, :5], g[:, :5])
    with pytest.raises(ShapeError, match=r"beta must have shape \(B, H, T\) = \(1, 6, 10\); got \(1, 2, 10\)"):
        rec.delta_rule(q, k, v, beta[:, :2], g)                     # the value heads', not q's
    with pytest.raises(ShapeError, match=r"initial_state must have shape \(B, H, Dk, Dv\) = \(1, 6, 4, 5\)"):
        rec.delta_rule(q, k, v, beta, g, initial_state=S0[:, :2])
    with pytest.raises(ShapeError, match=r"v must have shape \(B, H, T, Dv\) = \(1, 2, 10, Dv\); got \(1, 6, 10, 5\)"):
        rec.decay_attention(q, k, v, g)                             # only the delta rule groups
    with pytest.raises(ShapeError, match=r"dout must have the output's shape \(B, H, T, Dv\) = \(1, 6, 10, 5\)"):
        rec.delta_rule_backward(do[:, :2], q, k, v, beta, g)
