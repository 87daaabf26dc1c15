"""Options at their limits: saturated where the answer is defined, refused by name where it is
not, and never a raw OverflowError, a NaN or a long run before a MemoryError."""
import sys

import numpy as np
import pytest

import qkv
from qkv import api, distributed as dist


def _qkv(dtype=np.float64, shape=(2, 3, 7, 5), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(4)]


@pytest.mark.parametrize("method", ["reference", "flash"])
@pytest.mark.parametrize("huge,same_as", [
    (dict(window=(None, sys.maxsize)), dict()),
    (dict(window=(sys.maxsize, None)), dict()),
    (dict(window=2 ** 63), dict(causal=True)),
    (dict(window=(10 ** 30, 10 ** 30)), dict()),
    (dict(window=(2 ** 62, 0), align="bottom_right"), dict(causal=True, align="bottom_right")),
    (dict(chunk=10 ** 30), dict()),
    (dict(chunk=sys.maxsize, causal=True), dict(causal=True)),
])
def test_huge_windows_and_chunks_saturate(method, huge, same_as):
    """A window side or chunk beyond every distance in the problem means no limit: the
    answer of the problem without it, forward and gradients (an int64 overflow made rows 0)."""
    q, k, v, dout = _qkv()
    out, lse = qkv.attention(q, k, v, return_lse=True, method=method, **huge)
    want, want_lse = qkv.attention(q, k, v, return_lse=True, method="reference", **same_as)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    grads = qkv.attention_backward(dout, q, k, v, out, lse, method=method, **huge)
    for g, w in zip(grads, qkv.attention_backward(dout, q, k, v, want, want_lse, method="reference", **same_as)):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_chunk_past_the_sequence_keeps_rows_before_the_keys_apart():
    """bottom-right with Tq > Tk puts early rows at negative positions: a chunk of any size
    keeps them in another chunk than the keys, as with the exact huge chunk."""
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((1, 1, 6, 3)), rng.standard_normal((1, 1, 3, 3)), rng.standard_normal((1, 1, 3, 3))
    a = qkv.attention(q, k, v, chunk=10 ** 30, align="bottom_right", method="reference")
    b = qkv.attention(q, k, v, chunk=100, align="bottom_right", method="reference")
    np.testing.assert_array_equal(a, b)
    assert np.all(a[..., :3, :] == 0) and np.all(a[..., 3:, :] != 0)


@pytest.mark.parametrize("slopes,dtype", [([1e39, 1.0, 1.0], np.float32), ([3.4e38, 1, 1], np.float32),
                                          ([1e308, 1, 1], np.float64), ([-1e38, 1, 1], np.float32)])
def test_alibi_slopes_beyond_the_dtype_are_refused_by_name(slopes, dtype):
    q, k, v, _ = _qkv(dtype)
    with pytest.raises(qkv.ShapeError, match="alibi slopes times the largest distance"):
        qkv.attention(q, k, v, alibi=np.array(slopes))


def test_large_alibi_slopes_that_fit_give_no_nan():
    q, k, v, dout = _qkv(np.float32)
    slopes = np.array([1e30, 1e6, 0.5])
    for method in ("reference", "flash"):
        out, lse = qkv.attention(q, k, v, alibi=slopes, return_lse=True, method=method)
        grads = qkv.attention_backward(dout, q, k, v, out, lse, alibi=slopes, method=method)
        assert all(np.isfinite(x).all() for x in (out, *grads))


@pytest.mark.parametrize("method", ["reference", "flash"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_float64_bias_masking_a_row_beside_float32_inputs(method, dtype):
    """np.where(mask, 0, -1e30) is float64: a row it masks whole must get gradients whose P
    sums to 1 per row (v's gradient column sums equal dout's), not to the number of keys."""
    q, k, v, dout = _qkv(dtype, shape=(1, 2, 6, 4), seed=3)
    bias = np.zeros((1, 1, 6, 6))
    bias[..., 2, :] = -1e30
    bias[..., 4, :] = -1e38
    out, lse = qkv.attention(q, k, v, bias=bias, return_lse=True, method=method)
    dq, dk, dv = qkv.attention_backward(dout, q, k, v, out, lse, bias=bias, method=method)
    np.testing.assert_allclose(dv.astype(np.float64).sum(axis=-2), dout.astype(np.float64).sum(axis=-2),
                               rtol=2e-3 if dtype == np.float16 else 1e-5, atol=1e-3)
    ref = qkv.attention_backward(dout, q, k, v, out, lse, bias=bias, method="reference")
    for g, r in zip((dq, dk, dv), ref):
        np.testing.assert_allclose(g.astype(np.float64), r.astype(np.float64), rtol=1e-2, atol=2e-3)


def test_return_weights_too_big_fails_before_the_forward(monkeypatch):
    monkeypatch.setattr(api, "_available_bytes", lambda: 2 ** 30)
    q = np.zeros((1, 1, 20000, 8), np.float32)
    with pytest.raises(MemoryError, match=r"return_weights=True makes dense .* 4.5 GiB .* 1.0 GiB available"):
        qkv.attention(q, q, q, return_weights=True)
    with pytest.raises(MemoryError, match="method='reference'"):
        qkv.attention(q, q, q, method="reference")
    assert qkv.attention(q[..., :64, :], q[..., :64, :], q[..., :64, :], return_weights=True)[1].shape == (1, 1, 64, 64)


@pytest.mark.parametrize("call,match", [
    (lambda x: qkv.linear_attention(x, x, x, window=3), r"window= \(an option of qkv.attention; linear attention takes causal= and gqa= only\)"),
    (lambda x: qkv.linear_attention_backward(x, x, x, x, chunk=4), "chunk= .*causal= and gqa= only"),
    (lambda x: qkv.linear_attention(x, x, x, is_causal=True), "qkv's name: causal=True"),
    (lambda x: dist.ring_attention(x, x, x, q_lengths=np.array([2])), "q_lengths= .*kv_lengths= alone"),
    (lambda x: dist.ring_attention_backward(x, x, x, x, x, x[..., 0], return_weights=True), "return_weights="),
])
def test_options_an_entry_point_lacks_are_named(call, match):
    """Not a bare TypeError: the option, why this entry point has no such thing, and its options."""
    with pytest.raises(qkv.ShapeError, match=match):
        call(np.zeros((1, 2, 4, 3)))


def test_a_cache_of_another_dtype_is_named():
    layer64 = qkv.nn.MultiHeadAttention(16, 4, causal=True, dtype=np.float64)
    layer32 = qkv.nn.MultiHeadAttention(16, 4, causal=True, dtype=np.float32)
    with pytest.raises(qkv.ShapeError, match=r"cache 'k' must be float64 \(B, 4, max_len, 4\) for this layer; got float32"):
        layer64.forward(np.zeros((2, 3, 16)), cache=layer32.new_cache(2, 8))
    other = qkv.nn.MultiHeadAttention(16, 2, causal=True, dtype=np.float64)
    with pytest.raises(qkv.ShapeError, match=r"cache 'k' must be float64 \(B, 4, max_len, 4\)"):
        layer64.forward(np.zeros((2, 3, 16)), cache=other.new_cache(2, 8))


@pytest.mark.parametrize("kwargs", [dict(window=(-1, 0)), dict(causal="yes"), dict(scale=float("nan")),
                                    dict(method="fast"), dict(chunk=0), dict(is_causal=True),
                                    dict(causal=True, window=(2, 3)), dict(kv_lengths=np.array([9, 9]))])
def test_option_values_raise_option_error(kwargs):
    """OptionError for a bad option value, a conflict or an unknown keyword; still a ShapeError."""
    q, k, v, _ = _qkv()
    with pytest.raises(qkv.OptionError) as err:
        qkv.attention(q, k, v, **kwargs)
    assert isinstance(err.value, qkv.ShapeError) and isinstance(err.value, ValueError)


def test_shapes_raise_shape_error_not_option_error():
    q, k, v, _ = _qkv()
    with pytest.raises(qkv.ShapeError) as err:
        qkv.attention(q, k[..., :3], v)
    assert not isinstance(err.value, qkv.OptionError)


def test_the_kernel_registry_is_what_method_looks_up():
    from qkv import kernels
    from qkv.kernels.flash import forward as flash_forward

    assert kernels.names()[:2] == ("reference", "flash")
    with pytest.raises(qkv.OptionError, match=r"registered kernel: 'reference' \(dense, exact: the oracle\), 'flash'"):
        qkv.attention(*_qkv()[:3], method="triton")
    with pytest.raises(qkv.OptionError, match="already registered"):
        kernels.register(kernels.Kernel("flash", kernels.lookup("flash").impl, False, False, ""))
    with pytest.raises(qkv.OptionError, match="impl must have forward and backward"):
        kernels.register(kernels.Kernel("nothing", object(), False, False, ""))
    calls = []

    class Counting:
        @staticmethod
        def forward(*args, **kw):
            calls.append(1)
            return flash_forward(*args, **kw)

        backward = staticmethod(kernels.lookup("flash").backward)

    kern = kernels.Kernel("counting", Counting, makes_weights=False, dense=False, summary="a test's")
    kernels.register(kern)
    try:
        q, k, v, _ = _qkv()
        out, weights = qkv.attention(q, k, v, method="counting", return_weights=True)  # weights beside, by the dense path
        np.testing.assert_allclose(out, qkv.attention(q, k, v, method="reference"), rtol=1e-12)
        assert calls == [1] and weights.shape == (2, 3, 7, 7)
    finally:
        kernels.registry._KERNELS.pop("counting")
