"""The delta rule's compiled float32 forward and backward with a decay a key channel (Kimi Delta Attention:
qkv.recurrent.delta.channels_compiled, driven by qkv.recurrent.delta.channels) against the float64 step
oracle, within a budget of the NumPy float32 path's own error: mild, steep (-30 a step), resets (-1e4,
-3e38), none and mixed decays, channels of one head differing; T a multiple of the chunk and not, chunks of
2 to 64, Dk and Dv apart, with and without an initial state and dstate; queries at 30x (scores of +-30 and
more)."""
import numpy as np
import pytest

import qkv.recurrent as rec
from compiled_budget import BUDGET, check_within_budget, compiled_or_skip, counted, rel
from qkv import jit, threads
from qkv.recurrent.delta import channels, chunk as delta, naive as recurrence

SCALE = 0.7


def _inputs(B, H, T, Dk, Dv, decays, state, seed=0, q_times=1.0):
    rng = np.random.default_rng(seed + 7 * T + Dk)
    q, k = q_times * rng.standard_normal((B, H, T, Dk)), rng.standard_normal((B, H, T, Dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, H, T, Dv))
    beta = rng.uniform(0, 1, (B, H, T))
    shape = (B, H, T, Dk)
    g = {"mild": -rng.uniform(0, 0.5, shape), "steep": np.full(shape, -30.0), "none": np.zeros(shape),
         "mixed": -rng.uniform(0, 1, shape), "resets": -rng.uniform(0, 0.3, shape)}[decays]
    if decays == "mixed":
        g[rng.uniform(size=shape) < 0.15] = -30.0                  # some steps of some channels forget almost all
        g[..., : Dk // 4] = 0.0                                    # a quarter of the channels never decay
    if decays == "resets":
        hit = rng.uniform(size=shape) < 0.1
        g[hit] = rng.choice([-1e4, -3e38], size=int(hit.sum()))
    S0 = rng.standard_normal((B, H, Dk, Dv)) if state else None
    return q, k, v, beta, g, S0


def _f32(xs):
    return [None if x is None else x.astype(np.float32) for x in xs]


def _check(monkeypatch, inputs, chunk, seed=1):
    """Forward and backward of the compiled path within budget (``compiled_budget.BUDGET``), each array
    against the oracle's largest true entry."""
    mod = compiled_or_skip(jit.DELTA_CHANNELS)
    q, k, v, beta, g, S0 = inputs
    rng = np.random.default_rng(seed)
    do, dS = rng.standard_normal(v.shape), None if S0 is None else rng.standard_normal(S0.shape)
    want = recurrence.delta_forward(q, k, v, beta, g, scale=SCALE, initial_state=S0)
    want_grads = recurrence.delta_backward(do, dS, q, k, v, beta, g, scale=SCALE, initial_state=S0)
    x32 = _f32([q, k, v, beta, g, S0, do, dS])
    calls = {name: counted(monkeypatch, mod, name) for name in ("forward", "backward")}

    def run():
        return (delta.forward(*x32[:5], scale=SCALE, initial_state=x32[5], chunk=chunk),
                delta.backward(x32[6], x32[7], *x32[:5], scale=SCALE, initial_state=x32[5], chunk=chunk))
    got, got_grads = run()
    assert calls["forward"] and calls["backward"], "the compiled path did not run"
    monkeypatch.setitem(jit._loaded, jit.DELTA_CHANNELS, None)
    plain, plain_grads = run()
    for name, a, b, w in zip(("o", "S_T"), got, plain, want):
        assert a.dtype == np.float32 and a.shape == w.shape and np.isfinite(a).all(), name
        budget = BUDGET * max(rel(b, w), np.finfo(np.float32).eps)
        assert rel(a, w) <= budget, f"{name}: {rel(a, w):.2e} > {budget:.2e} (NumPy path {rel(b, w):.2e})"
    check_within_budget(["dq", "dk", "dv", "dbeta", "dg", "dS0"], got_grads, plain_grads, want_grads,
                        absent=() if S0 is not None else ("dS0",))


@pytest.mark.parametrize("B, H, T, Dk, Dv, chunk", [(1, 2, 96, 16, 24, None), (2, 3, 100, 32, 16, None),
                                                     (1, 2, 130, 72, 40, 32), (1, 1, 5, 4, 6, None),
                                                     (1, 2, 67, 8, 8, 2), (1, 1, 200, 64, 64, 64)])
@pytest.mark.parametrize("decays", ["mild", "steep", "none", "mixed", "resets"])
@pytest.mark.parametrize("state", [True, False], ids=["state", "no-state"])
def test_compiled_forward_within_budget_of_the_numpy_path(monkeypatch, B, H, T, Dk, Dv, chunk, decays, state):
    _check(monkeypatch, _inputs(B, H, T, Dk, Dv, decays, state), chunk)


@pytest.mark.parametrize("decays", ["mild", "mixed"])
def test_scores_of_thirty_and_more(monkeypatch, decays):
    """Queries 30x the unit ones: scores ``q·k`` of +-30 and more (realistic unnormalised queries)."""
    _check(monkeypatch, _inputs(1, 2, 300, 64, 64, decays, True, q_times=30.0), None)


def test_a_kimi_head_at_length_1024(monkeypatch):
    """Kimi Linear's head (Dk = Dv = 128) at T = 1024: the error does not grow past the budget with length."""
    _check(monkeypatch, _inputs(1, 1, 1024, 128, 128, "mild", True, seed=3), None)


def test_steep_decays_keep_their_tiny_gradients():
    """Odd channels at -30 a step: each such channel's dg is a sum of terms as tiny as the factors that
    cross its steps, held to the oracle per channel (against that channel's largest true entry)."""
    compiled_or_skip(jit.DELTA_CHANNELS)
    q, k, v, beta, g, S0 = _inputs(1, 1, 64, 8, 8, "steep", True)
    g[..., ::2] = -0.5                                              # even channels mild
    rng = np.random.default_rng(2)
    do, dS = rng.standard_normal(v.shape), rng.standard_normal(S0.shape)
    want = recurrence.delta_backward(do, dS, q, k, v, beta, g, scale=SCALE, initial_state=S0)[4]
    got = delta.backward(*_f32([do, dS, q, k, v, beta, g]), scale=SCALE, initial_state=_f32([S0])[0])[4]
    for d in range(1, 8, 2):
        assert np.abs(want[..., 1:, d]).max() < 1e-9                  # they are tiny
        assert rel(got[..., 1:, d], want[..., 1:, d]) < 1e-4, d


def test_float64_and_chunks_of_one_keep_the_numpy_path(monkeypatch):
    """float64 and a chunk of one row (what inputs that are not finite are given: the step loop) never
    run compiled (the backward asks the same question: compiled_chunk)."""
    mod = compiled_or_skip(jit.DELTA_CHANNELS)
    calls = counted(monkeypatch, mod, "forward")
    q, k, v, beta, g, S0 = _inputs(1, 2, 40, 8, 8, "mild", True)
    delta.forward(q, k, v, beta, g, scale=0.5, initial_state=S0)
    assert channels.compiled_chunk(None, np.float64, 40) is None
    x32 = _f32([q, k, v, beta, g, S0])
    delta.forward(*x32[:5], scale=0.5, initial_state=x32[5], chunk=1)
    assert not calls
    x32[0][0, 0, 3, 1] = np.nan                                       # through the API: the step loop
    o = rec.delta_rule(*x32[:5], scale=0.5, initial_state=x32[5])
    assert not calls and np.isnan(o[0, 0, 3:]).any() and np.isfinite(o[0, 0, :3]).all()
    delta.forward(*_f32([q, k, v, beta, g]), scale=0.5, initial_state=x32[5])
    assert calls


def test_same_bits_on_any_thread_count_and_again():
    """Heads run one after the other in the compiled loop, groups of them on the threads: the same bits on
    1, 2 and 3 threads, and in a second call."""
    compiled_or_skip(jit.DELTA_CHANNELS)
    q, k, v, beta, g, S0 = _f32(_inputs(2, 5, 77, 16, 8, "mixed", True, seed=4))
    runs = []
    for n in (1, 2, 3, 1):
        threads.set_num_threads(n)
        try:
            runs.append([*rec.delta_rule(q, k, v, beta, g, initial_state=S0, return_state=True),
                         *rec.delta_rule_backward(v, q, k, v, beta, g, initial_state=S0, dstate=S0)])
        finally:
            threads.set_num_threads(None)
    for other in runs[1:]:
        for a, b in zip(other, runs[0]):
            np.testing.assert_array_equal(a, b)
