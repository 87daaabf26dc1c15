"""align=, q_lengths, per-sequence alignment and chunk=: flash-attn's conventions exactly.

The oracle is tests/oracle.py, written from the definitions (issue 15, DESIGN.md), not from
qkv.masks: query i of batch item b sits at ``i' = i + off_b`` with ``off_b = Tk_b - Tq_b``
(real lengths) under bottom-right alignment and 0 under top-left; causal ``j <= i'``; window
``i' - left <= j <= i' + right``; chunk ``i' // C == j // C``; ALiBi ``-slope·|i' - j|``;
keys ``j >= kv_lengths[b]`` and query rows ``i >= q_lengths[b]`` do not exist.
"""
import numpy as np
import pytest

import oracle
import qkv


# flash-attn's test grid, reduced: seqlen pairs both ways, MHA/GQA/MQA, odd head dims
SIZES = [(1, 7), (7, 1), (13, 29), (29, 13), (113, 203), (203, 113), (128, 128)]
KINDS = {
    "causal": dict(causal=True),
    "window": dict(window=(9, 4)),
    "window_causal": dict(causal=True, window=(6, 0)),
    "alibi": dict(alibi="heads"),
    "alibi_batch_causal": dict(causal=True, alibi="batch"),
    "kv_padding_causal": dict(causal=True, kv_lengths=True),
    "q_and_kv_padding_window": dict(window=(5, 3), kv_lengths=True, q_lengths=True),
    "chunk_causal": dict(causal=True, chunk=5),
    "chunk_padding": dict(chunk=16, kv_lengths=True, q_lengths=True, alibi="heads"),
}


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_matches_the_definitions_float64(align, kind, heads):
    rng = np.random.default_rng(abs(hash((align, kind, heads))) % 2**32)
    hq, hkv = heads
    b, d = 2, 19
    for tq, tk in SIZES:
        opts = dict(KINDS[kind])
        if opts.pop("kv_lengths", False):
            opts["kv_lengths"] = rng.integers(0, tk + 1, size=b)
        if opts.pop("q_lengths", False):
            opts["q_lengths"] = rng.integers(0, tq + 1, size=b)
        slopes = opts.pop("alibi", None)
        if slopes == "heads":
            opts["alibi"] = rng.random(hq)
        elif slopes == "batch":
            opts["alibi"] = rng.random((b, hq))
        q = rng.standard_normal((b, hq, tq, d))
        k = rng.standard_normal((b, hkv, tk, d))
        v = rng.standard_normal((b, hkv, tk, d + 2))
        dout = rng.standard_normal((b, hq, tq, d + 2))
        want = oracle.solve(q, k, v, dout, align=align, scale=0.4, gqa=True, **opts)
        want_out, want_lse, want_grads = want.out, want.lse, (want.dq, want.dk, want.dv)
        for method in ("reference", "flash"):
            out, lse = qkv.attention(q, k, v, align=align, scale=0.4, gqa=True, return_lse=True,
                                     method=method, **opts)
            np.testing.assert_allclose(out, want_out, atol=1e-12, err_msg=f"{method} {tq}x{tk}")
            np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
            np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], atol=1e-12)
            grads = qkv.attention_backward(dout, q, k, v, out, lse, align=align, scale=0.4, gqa=True,
                                           method=method, **opts)
            for name, got, want in zip("qkv", grads, want_grads):
                np.testing.assert_allclose(got, want, atol=1e-11, err_msg=f"d{name} {method} {tq}x{tk}")


def allowed(tq, tk, **opts):
    _, w = qkv.attention(np.zeros((1, 1, tq, 4)), np.zeros((1, 1, tk, 4)), np.ones((1, 1, tk, 1)),
                         return_weights=True, method="reference", **opts)
    return (w[0, 0] > 0).astype(int)


def test_the_issues_pictures():
    # a non-causal window aligned bottom-right (flash-attn's window_size=(1, 1))
    np.testing.assert_array_equal(allowed(2, 5, window=(1, 1), align="bottom_right"),
                                  [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(allowed(2, 5, window=(1, 1)), [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    # causal with 3 real keys in a buffer of 5: aligned to the real length (cache_seqlens)
    np.testing.assert_array_equal(allowed(2, 5, causal=True, align="bottom_right", kv_lengths=[3]),
                                  [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(allowed(6, 6, causal=True, chunk=3),
                                  np.kron(np.eye(2, dtype=int), np.tril(np.ones((3, 3), int))))


@pytest.mark.parametrize("method", ["reference", "flash"])
def test_shorthands_are_bit_identical(method):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, 37, 16)).astype(np.float32)
    k = rng.standard_normal((2, 2, 53, 16)).astype(np.float32)
    v = rng.standard_normal((2, 2, 53, 16)).astype(np.float32)
    for short, full in [("bottom_right", "bottom_right"), ("top_left", "top_left"), (True, "top_left")]:
        a = qkv.attention(q, k, v, gqa=True, causal=short, window=7, method=method)
        b = qkv.attention(q, k, v, gqa=True, causal=True, align=full, window=7, method=method)
        np.testing.assert_array_equal(a, b)
    slopes = rng.random(4)
    a = qkv.attention(q, k, v, gqa=True, causal="bottom_right", alibi=slopes, method=method)
    b = qkv.attention(q, k, v, gqa=True, causal=True, align="bottom_right", alibi=slopes, method=method)
    np.testing.assert_array_equal(a, b)
    a = qkv.attention(q, k, v, gqa=True, window=(3, 2), alibi=slopes, method=method)
    b = qkv.attention(q, k, v, gqa=True, window=(3, 2), alibi=slopes, align="top_left", method=method)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("method", ["reference", "flash"])
def test_padding_rows_are_never_read(method):
    rng = np.random.default_rng(4)
    q = rng.standard_normal((3, 2, 40, 8))
    k = rng.standard_normal((3, 2, 50, 8))
    v = rng.standard_normal((3, 2, 50, 8))
    qn, kn, vn = q.copy(), k.copy(), v.copy()
    qn[0, :, 30:] = np.nan
    qn[2, :, 1:] = np.nan
    kn[1, :, 20:] = np.nan
    vn[1, :, 20:] = np.inf
    opts = dict(q_lengths=[30, 40, 1], kv_lengths=[50, 20, 50], causal=True, align="bottom_right")
    out, lse = qkv.attention(qn, kn, vn, return_lse=True, method=method, **opts)
    ref, ref_lse = qkv.attention(q, k, v, return_lse=True, method="reference", **opts)
    np.testing.assert_allclose(out, ref, atol=1e-12)
    assert (out[0, :, 30:] == 0).all() and (lse[0, :, 30:] == -np.inf).all()
    dout = rng.standard_normal(out.shape)
    dout[0, :, 30:] = np.nan  # the gradient of a padding row is never read either
    dq, dk, dv = qkv.attention_backward(dout, qn, kn, vn, out, lse, method=method, **opts)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert (dq[0, :, 30:] == 0).all() and (dk[1, :, 20:] == 0).all() and (dv[1, :, 20:] == 0).all()


def test_option_errors_name_the_argument():
    x = np.zeros((1, 2, 4, 8))
    with pytest.raises(qkv.ShapeError, match="align"):
        qkv.attention(x, x, x, align="bottom")
    with pytest.raises(qkv.ShapeError, match="conflicts with align"):
        qkv.attention(x, x, x, causal="top_left", align="bottom_right")
    with pytest.raises(qkv.ShapeError, match="chunk"):
        qkv.attention(x, x, x, chunk=0)
    with pytest.raises(qkv.ShapeError, match="q_lengths"):
        qkv.attention(x, x, x, q_lengths=[5])
    with pytest.raises(qkv.ShapeError, match=r"alibi must be .*\(B, Hq\)"):
        qkv.attention(x, x, x, alibi=np.ones((3, 2)))
    with pytest.raises(qkv.ShapeError, match="causal"):
        qkv.attention(x, x, x, causal=1)
    with pytest.raises(qkv.ShapeError, match="conflicts with causal"):
        qkv.attention(x, x, x, causal=True, align="bottom_right", window=(2, 1))
    # not causal, bottom-right: a window may reach right
    qkv.attention(x, x, x, align="bottom_right", window=(2, 1))
