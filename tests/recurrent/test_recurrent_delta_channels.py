"""The delta rule with a decay a key channel (Kimi Delta Attention: qkv.recurrent.delta.channels)
against its float64 step oracle (qkv.recurrent.delta.naive), finite differences, the float32
step loop, and flash-linear-attention's naive_recurrent_kda."""
import numpy as np
import pytest

import qkv
import qkv.recurrent as rec
from qkv.recurrent.delta import chunk as delta, naive as recurrence

B, H, DK, DV = 1, 2, 6, 5
SCALE = 0.7
NAMES = ["o", "S_T", "dq", "dk", "dv", "dbeta", "dg", "dS0"]


def _inputs(T, regime, state=True, seed=0, dims=(B, H, DK, DV)):
    """``(q, k, v, beta, g, S0, do, dS)`` in float64, ``g (B, H, T, Dk)``."""
    b, h, dk, dv = dims
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((b, h, T, dk)), rng.standard_normal((b, h, T, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v, do = rng.standard_normal((b, h, T, dv)), rng.standard_normal((b, h, T, dv))
    beta = rng.uniform(0, 1, (b, h, T))
    g = -rng.uniform(0, 1, (b, h, T, dk))
    if regime == "strong":                                # some channels of some steps forget everything
        g[rng.uniform(size=g.shape) < 0.2] = -30.0
    elif regime == "resets":                              # a fifth at -30, -1e4, -3e38
        hit = rng.random(g.shape) < 0.2
        g[hit] = rng.choice([-30.0, -1e4, -3e38], size=int(hit.sum()))
    elif regime == "split":                               # half the channels steep, half mild
        g[..., : dk // 2] = -30.0
    elif isinstance(regime, (int, float)):                # every channel of every step
        g[:] = float(regime)
    S0, dS = (rng.standard_normal((b, h, dk, dv)) if state else None for _ in range(2))
    return q, k, v, beta, g, S0, do, dS


def _oracle(q, k, v, beta, g, S0, do, dS, dtype=np.float64):
    o, S = recurrence.delta_forward(q, k, v, beta, g, scale=SCALE, initial_state=S0, dtype=dtype)
    return [o, S, *recurrence.delta_backward(do, dS, q, k, v, beta, g, scale=SCALE, initial_state=S0, dtype=dtype)]


def _rel(x, ref):
    """Largest error relative to the largest true entry (1 where the truth is all zero)."""
    ref = np.asarray(ref, np.float64)
    return float(np.abs(np.asarray(x, np.float64) - ref).max(initial=0) / max(np.abs(ref).max(initial=0), 1e-300))


@pytest.mark.parametrize("T", [1, 5, 16, 37, 100])
@pytest.mark.parametrize("regime", ["mild", "strong"])
@pytest.mark.parametrize("state", [False, True])
def test_chunked_equals_the_step_oracle(T, regime, state):
    """float64, chunks of 1, 3, 16 (the default) and 64: outputs, final state and every gradient
    to 1e-10 of each array's largest true entry."""
    x = _inputs(T, regime, state)
    want = _oracle(*x)
    q, k, v, beta, g, S0, do, dS = x
    for chunk in (1, 3, None, 64):
        o, S = delta.forward(q, k, v, beta, g, scale=SCALE, initial_state=S0, chunk=chunk)
        got = [o, S, *delta.backward(do, dS, q, k, v, beta, g, scale=SCALE, initial_state=S0, chunk=chunk)]
        for name, a, b in zip(NAMES, got, want):
            if name == "dS0" and S0 is None:
                assert a is None, name
            else:
                assert a.shape == b.shape and _rel(a, b) <= 1e-10, (chunk, name, _rel(a, b))


@pytest.mark.parametrize("steep", [-10, -20, -30, "resets", "split"])
def test_steep_decays_every_gradient_to_1e_10_in_float64(steep):
    """At g = -30 a step the true dg is about exp(-30) of the other gradients: summed over the
    steps each factor crosses (qkv.recurrent.crossing), it keeps 1e-10 of its largest entry."""
    q, k, v, beta, g, S0, do, dS = _inputs(100, steep, seed=3)
    want = _oracle(q, k, v, beta, g, S0, do, dS)
    o, S = rec.delta_rule(q, k, v, beta, g, scale=SCALE, initial_state=S0, return_state=True)
    got = [o, S, *rec.delta_rule_backward(do, q, k, v, beta, g, scale=SCALE, initial_state=S0, dstate=dS)]
    for name, a, b in zip(NAMES, got, want):
        assert np.isfinite(a).all() and _rel(a, b) <= 1e-10, (name, _rel(a, b))


def test_oracle_against_finite_differences():
    """The oracle's dg a key channel (and every other gradient) against central differences."""
    q, k, v, beta, g, S0, do, dS = _inputs(6, "mild", dims=(1, 1, 3, 2), seed=5)

    def loss(q, k, v, beta, g, S0):
        o, S = recurrence.delta_forward(q, k, v, beta, g, scale=SCALE, initial_state=S0)
        return float((o * do).sum() + (S * dS).sum())
    args = [q, k, v, beta, g, S0]
    grads = recurrence.delta_backward(do, dS, *args[:5], scale=SCALE, initial_state=S0)
    for i, x in enumerate(args):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + 1e-6
            up = loss(*args)
            x[idx] = old - 1e-6
            num[idx] = (up - loss(*args)) / 2e-6
            x[idx] = old
        np.testing.assert_allclose(grads[i], num, atol=1e-7, err_msg=str(i))


def test_equal_channels_are_the_head_decay():
    """A decay a key channel that is the same on every channel is Gated DeltaNet's: the outputs
    match the head form's, and dg summed over the channels is its dg."""
    q, k, v, beta, g, S0, do, dS = _inputs(40, "mild", seed=7)
    g1 = g[..., 0]
    gc = np.repeat(g1[..., None], DK, -1)
    o1, S1 = rec.delta_rule(q, k, v, beta, g1, initial_state=S0, return_state=True)
    oc, Sc = rec.delta_rule(q, k, v, beta, gc, initial_state=S0, return_state=True)
    assert _rel(oc, o1) <= 1e-12 and _rel(Sc, S1) <= 1e-12
    d1 = rec.delta_rule_backward(do, q, k, v, beta, g1, initial_state=S0, dstate=dS)
    dc = rec.delta_rule_backward(do, q, k, v, beta, gc, initial_state=S0, dstate=dS)
    assert dc[4].shape == gc.shape
    assert _rel(dc[4].sum(-1), d1[4]) <= 1e-12
    for a, b in zip(dc[:4] + dc[5:], d1[:4] + d1[5:]):
        assert _rel(a, b) <= 1e-12


@pytest.mark.parametrize("regime", ["mild", "strong", -30])
def test_float32_within_budget_of_the_float32_step_loop(regime):
    """float32: every output and gradient within 2x (outputs) and 5x (gradients) of the plain
    float32 step loop's own error against float64 (the head form's budget)."""
    x64 = _inputs(100, regime, seed=11)
    want = _oracle(*x64)
    x32 = [x.astype(np.float32) for x in x64]
    steps = _oracle(*x32, dtype=np.float32)
    q, k, v, beta, g, S0, do, dS = x32
    o, S = rec.delta_rule(q, k, v, beta, g, scale=SCALE, initial_state=S0, return_state=True)
    got = [o, S, *rec.delta_rule_backward(do, q, k, v, beta, g, scale=SCALE, initial_state=S0, dstate=dS)]
    for i, (name, a, s, w) in enumerate(zip(NAMES, got, steps, want)):
        assert a.dtype == np.float32, name
        budget = (2.0 if i < 2 else 5.0) * max(_rel(s, w), np.finfo(np.float32).eps)
        assert _rel(a, w) <= budget, (name, _rel(a, w), _rel(s, w))


def test_a_wrong_log_decay_shape_is_named():
    q, k, v, beta, g, S0, do, dS = _inputs(5, "mild")
    with pytest.raises(qkv.ShapeError, match=r"log_decay must have shape \(B, H, T\) = \(1, 2, 5\) or "
                                             r"\(B, H, T, Dk\) = \(1, 2, 5, 6\); got \(1, 2, 5, 4\)"):
        rec.delta_rule(q, k, v, beta, g[..., :4])
    with pytest.raises(qkv.ShapeError, match="log_decay must be finite and <= 0"):
        rec.delta_rule_backward(do, q, k, v, beta, -g)


def test_against_fla_naive_recurrent_kda():
    """fla's naive_recurrent_kda (float32 inside) in (B, T, H, ·) layout: within float32's reach."""
    from fla_reference import naive
    fla_kda = naive("kda")
    import torch
    q, k, v, beta, g, S0, do, dS = _inputs(50, "strong", seed=9)
    o, S = rec.delta_rule(q, k, v, beta, g, scale=SCALE, initial_state=S0, return_state=True)

    def bthd(x):
        return torch.from_numpy(np.ascontiguousarray(np.swapaxes(x, 1, 2)))
    o_f, S_f = fla_kda.naive_recurrent_kda(bthd(q), bthd(k), bthd(v), bthd(g), bthd(beta), scale=SCALE,
                                           initial_state=torch.from_numpy(S0), output_final_state=True)
    assert _rel(np.swapaxes(o_f.double().numpy(), 1, 2), o) <= 1e-5
    assert _rel(S_f.double().numpy(), S) <= 1e-5


def test_same_bits_on_any_thread_count():
    """Heads split over threads (in groups bounded by the decay blocks' memory): the same bits."""
    from qkv import threads
    q, k, v, beta, g, S0, do, dS = _inputs(100, "strong", dims=(1, 8, DK, DV), seed=12)
    runs = []
    for n in (1, 2, 3):
        threads.set_num_threads(n)
        try:
            o, S = rec.delta_rule(q, k, v, beta, g, initial_state=S0, return_state=True)
            runs.append([o, S, *rec.delta_rule_backward(do, q, k, v, beta, g, initial_state=S0, dstate=dS)])
        finally:
            threads.set_num_threads(None)
    for other in runs[1:]:
        for a, b in zip(other, runs[0]):
            np.testing.assert_array_equal(a, b)
