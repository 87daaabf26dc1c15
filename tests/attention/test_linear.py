"""qkv.linear_attention and its backward: against the quadratic form written out here,
finite differences, float64, and a memory budget of O(T·D)."""
import tracemalloc

import numpy as np
import pytest

import qkv
from qkv.kernels import linear as kern


def phi(x):
    return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))


def quadratic(q, k, v, causal=False, gqa=False):
    """The brute-force oracle: every weight φ(q_i)·φ(k_j) in a (Tq, Tk) array, normalised by its row."""
    tq, tk = q.shape[-2], k.shape[-2]
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    w = phi(q) @ np.swapaxes(phi(k), -1, -2)
    if causal:
        offset = tk - tq if causal == "bottom_right" else 0
        w = w * (np.arange(tk)[None, :] <= np.arange(tq)[:, None] + offset)
    den = w.sum(-1, keepdims=True)
    return np.where(den > 0, (w @ v) / np.where(den > 0, den, 1), 0)


def case(rng, *, b=2, hq=4, hkv=4, tq=7, tk=7, d=8, dv=5, dtype=np.float64):
    q = rng.standard_normal((b, hq, tq, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, tk, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, tk, dv)).astype(dtype)
    return q, k, v


SIZES = [(1, 1), (7, 7), (5, 9), (9, 5), (97, 97), (150, 150), (1, 130), (130, 1)]
HEADS = {"mha": (4, 4, False), "gqa": (4, 2, True), "mqa": (4, 1, True)}


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("tq,tk", SIZES)
@pytest.mark.parametrize("heads", list(HEADS))
def test_equals_the_quadratic_form(causal, tq, tk, heads):
    hq, hkv, gqa = HEADS[heads]
    q, k, v = case(np.random.default_rng(tq * 1000 + tk), hq=hq, hkv=hkv, tq=tq, tk=tk, d=59 if tq == 97 else 8)
    got = qkv.linear_attention(q, k, v, causal=causal, gqa=gqa)
    want = quadratic(q, k, v, causal, gqa)
    assert got.shape == want.shape and got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-8 * np.abs(want).max())


def test_leading_axes_broadcast_and_two_dimensional_input_works():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((6, 4)), rng.standard_normal((3, 6, 4)), rng.standard_normal((3, 6, 2))
    np.testing.assert_allclose(qkv.linear_attention(q, k, v, causal=True), quadratic(q, k, v, True), rtol=1e-10)
    dq, dk, dv = qkv.linear_attention_backward(np.ones((3, 6, 2)), q, k, v, causal=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_top_left_and_bottom_right_agree_when_square_and_differ_otherwise():
    q, k, v = case(np.random.default_rng(2), tq=5, tk=9)
    sq = case(np.random.default_rng(3), tq=6, tk=6)
    np.testing.assert_array_equal(qkv.linear_attention(*sq, causal=True), qkv.linear_attention(*sq, causal="bottom_right"))
    assert not np.allclose(qkv.linear_attention(q, k, v, causal=True), qkv.linear_attention(q, k, v, causal="bottom_right"))


def test_a_query_that_sees_no_key_gets_zero_output_and_zero_gradient():
    q, k, v = case(np.random.default_rng(4), tq=9, tk=5)  # bottom-right: queries 0..3 see nothing
    out = qkv.linear_attention(q, k, v, causal="bottom_right")
    assert np.all(out[..., :4, :] == 0) and np.all(np.abs(out[..., 4:, :]).sum(-1) > 0)
    dq, _, _ = qkv.linear_attention_backward(np.ones_like(out), q, k, v, causal="bottom_right")
    assert np.all(dq[..., :4, :] == 0)


def test_extreme_inputs_give_no_overflow_or_nan():
    for dtype in (np.float32, np.float64):
        q, k, v = case(np.random.default_rng(5), dtype=dtype)
        for x in (q * 1e4, q - 1e4):  # φ = x + 1 for huge x; exp(-1e4) = 0 underflows: output 0, no NaN
            out = qkv.linear_attention(x, k, v, causal=True)
            grads = qkv.linear_attention_backward(np.ones_like(out), x, k, v, causal=True)
            assert all(np.isfinite(a).all() for a in (out,) + grads)


def numeric_grad(f, x, r, eps=1e-6, picks=12, seed=0):
    """Central differences of sum(f() * r) at ``picks`` random entries of x (perturbed in place)."""
    rng = np.random.default_rng(seed)
    flat = x.reshape(-1)
    idx = rng.choice(flat.size, size=min(picks, flat.size), replace=False)
    out = []
    for i in idx:
        old = flat[i]
        flat[i] = old + eps
        up = np.sum(f() * r)
        flat[i] = old - eps
        down = np.sum(f() * r)
        flat[i] = old
        out.append((up - down) / (2 * eps))
    return idx, np.array(out)


@pytest.mark.parametrize("causal,tq,tk,heads", [
    (False, 7, 9, "mha"), (False, 6, 6, "gqa"), (True, 150, 150, "gqa"), (True, 5, 9, "mqa"),
    ("bottom_right", 9, 5, "mha"), ("bottom_right", 70, 140, "gqa"), (True, 140, 70, "mqa"),
])
def test_gradients_match_finite_differences(causal, tq, tk, heads):
    hq, hkv, gqa = HEADS[heads]
    rng = np.random.default_rng(tq + tk)
    q, k, v = case(rng, b=1, hq=hq, hkv=hkv, tq=tq, tk=tk, d=6, dv=3)
    r = rng.standard_normal((1, hq, tq, 3))
    grads = qkv.linear_attention_backward(r, q, k, v, causal=causal, gqa=gqa)
    for x, g in zip((q, k, v), grads):
        idx, num = numeric_grad(lambda: qkv.linear_attention(q, k, v, causal=causal, gqa=gqa), x, r)
        np.testing.assert_allclose(g.reshape(-1)[idx], num, atol=1e-7 * max(1.0, np.abs(g).max()))


@pytest.mark.parametrize("causal", [False, True])
def test_float32_at_t4096_is_within_1e4_of_float64(causal):
    q, k, v = case(np.random.default_rng(6), b=1, hq=1, hkv=1, tq=4096, tk=4096, d=64, dv=64)
    want = qkv.linear_attention(q, k, v, causal=causal)
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    got = qkv.linear_attention(q32, k32, v32, causal=causal)
    assert got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    r = np.random.default_rng(7).standard_normal(want.shape)
    for g32, g64 in zip(qkv.linear_attention_backward(r.astype(np.float32), q32, k32, v32, causal=causal),
                        qkv.linear_attention_backward(r, q, k, v, causal=causal)):
        assert g32.dtype == np.float32
        assert np.abs(g32 - g64).max() <= 1e-4 * np.abs(g64).max()


def test_float16_computes_in_float32_and_returns_float16():
    q, k, v = case(np.random.default_rng(8), dtype=np.float16)
    out = qkv.linear_attention(q, k, v, causal=True)
    assert out.dtype == np.float16
    want = quadratic(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    assert np.abs(out - want).max() < 2e-3
    assert all(g.dtype == np.float16 for g in qkv.linear_attention_backward(out, q, k, v, causal=True))


def test_the_compensated_state_stays_accurate_over_a_long_decode():
    """T = 20000 one-token additions in float32: the state the decoding step keeps. A plain
    running sum loses ~1e-5 of it; the compensated one stays at float32's rounding."""
    rng = np.random.default_rng(9)
    b = kern.feature(rng.standard_normal((20000, 8)))
    u = np.concatenate([rng.standard_normal((20000, 4)) + 1, np.ones((20000, 1))], axis=1)
    exact = b.T @ u  # float64
    s = comp = np.zeros((8, 5), np.float32)
    plain = np.zeros((8, 5), np.float32)
    for bt, ut in zip(b.astype(np.float32), u.astype(np.float32)):
        term = np.outer(bt, ut)
        s, comp = kern.compensated_add(s, comp, term)
        plain += term
    rel = lambda x: np.abs(x - exact).max() / np.abs(exact).max()
    assert rel(s - comp) < 2e-7 < 10 * 2e-7 < rel(plain)


@pytest.mark.parametrize("causal", [False, True])
def test_memory_grows_like_t_not_t_squared(causal):
    """Peak traced memory (NumPy reports its buffers to tracemalloc) of forward+backward,
    at T and 4T: it grows about 4x and stays within a few dozen (T, D) arrays."""
    d = 16
    peaks = {}
    for t in (2048, 8192):
        q, k, v = case(np.random.default_rng(10), b=1, hq=1, hkv=1, tq=t, tk=t, d=d, dv=d, dtype=np.float32)
        tracemalloc.start()
        out = qkv.linear_attention(q, k, v, causal=causal)
        qkv.linear_attention_backward(out, q, k, v, causal=causal)
        peaks[t] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        per_row = (d + kern.CHUNK) * 4  # one float32 row of D features and of a chunk's scores
        assert peaks[t] < 40 * t * per_row, (t, peaks[t])
        assert peaks[t] < t * t * 4 / 4  # a single (T, T) float32 score matrix would be 4x this
    assert 3.0 < peaks[8192] / peaks[2048] < 5.0, peaks


def test_bad_inputs_raise_the_same_errors_as_attention():
    rng = np.random.default_rng(11)
    q, k, v = case(rng)
    bad = [
        dict(k=k[..., :5]), dict(v=v[:, :, :3]), dict(q=q.astype(np.float32)), dict(q=q.astype(int)),
        dict(q=q[0, 0, 0]), dict(k=k[:, :3], gqa=True), dict(causal="left"), dict(gqa="yes"),
    ]
    for change in bad:
        args = dict(q=q, k=k, v=v)
        args.update(change)
        with pytest.raises(qkv.ShapeError) as ours:
            qkv.linear_attention(**args)
        with pytest.raises(qkv.ShapeError) as theirs:
            qkv.attention(**args)
        assert str(ours.value) == str(theirs.value)
        assert ours.traceback[-1].name == "linear_attention"  # raised from the public entry point
    with pytest.raises(qkv.ShapeError, match=r"dout must have the output's shape \(\.\.\., Hq, Tq, Dv\) = \(2, 4, 7, 5\)"):
        qkv.linear_attention_backward(np.ones((2, 4, 7, 4)), q, k, v)


def test_float32_errs_no_more_than_twice_the_plain_float32_quadratic_form():
    """The numerics policy: against float64, at most twice the error of the dense float32 form."""
    q, k, v = case(np.random.default_rng(12), b=1, hq=2, hkv=2, tq=1024, tk=1024, d=32, dv=32)
    want = quadratic(q, k, v, True)
    plain = quadratic(*(x.astype(np.float32) for x in (q, k, v)), True)
    got = qkv.linear_attention(*(x.astype(np.float32) for x in (q, k, v)), causal=True)
    assert np.abs(got - want).max() <= 2 * np.abs(plain - want).max()
