"""Properties of the exact reference that the texts state, checked by hypothesis."""
import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import qkv

dims = st.integers(1, 9)
seeds = st.integers(0, 2**32 - 1)


@settings(max_examples=60, deadline=None)
@given(seed=seeds, tq=dims, tk=dims, d=dims, p_mask=st.floats(0, 1),
       causal=st.sampled_from([False, True, "bottom_right"]),
       window=st.none() | st.tuples(st.none() | st.integers(0, 4), st.none() | st.integers(0, 4)))
def test_weight_rows_sum_to_one_or_are_all_zero(seed, tq, tk, d, p_mask, causal, window):
    assume(not (causal and window is not None and (window[1] or 0) > 0))  # a conflict: see test_errors
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((2, tq, d)), rng.standard_normal((2, tk, d)), rng.standard_normal((2, tk, 3))
    mask = rng.random((2, tq, tk)) >= p_mask
    out, w = qkv.attention(q, k, v, mask=mask, causal=causal, window=window, return_weights=True)
    sums = w.sum(-1)
    alive = sums > 0
    np.testing.assert_allclose(sums[alive], 1.0, rtol=1e-12)
    assert (w >= 0).all()
    np.testing.assert_array_equal(out[~alive], 0.0)
    # a weight is non-zero only where attending is allowed
    assert not (w[~mask] > 0).any()


@settings(max_examples=40, deadline=None)
@given(seed=seeds, t=st.integers(1, 12), d_model=st.integers(1, 8), d_k=st.integers(1, 8))
def test_self_attention_without_masks_is_permutation_equivariant(seed, t, d_model, d_k):
    """The texts' "no sense of order": shuffling the tokens shuffles the outputs the same way."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, d_model))
    w_q, w_k, w_v = (rng.standard_normal((d_model, d_k)) for _ in range(3))
    perm = rng.permutation(t)

    def layer(x):
        return qkv.attention(x @ w_q, x @ w_k, x @ w_v)  # (T, d_model) @ (d_model, d_k) -> (T, d_k)

    np.testing.assert_allclose(layer(x[perm]), layer(x)[perm], rtol=1e-10, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(seed=seeds, t=st.integers(1, 10), d=st.integers(1, 8))
def test_tied_query_and_key_projections_give_a_symmetric_score_matrix(seed, t, d):
    """With W_Q = W_K the scores S = X W Wᵀ Xᵀ are symmetric; recover S from the weights and lse."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, d))
    w = rng.standard_normal((d, d))
    q = k = x @ w
    _, lse, weights = qkv.attention(q, k, x, return_lse=True, return_weights=True)
    with np.errstate(divide="ignore"):
        scores = np.log(weights) + lse[:, None]  # log softmax + lse = scaled scores
    finite = np.isfinite(scores) & np.isfinite(scores.T)
    np.testing.assert_allclose(scores[finite], scores.T[finite], rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(scores[finite], ((q @ k.T) / np.sqrt(d))[finite], rtol=1e-8, atol=1e-8)


@settings(max_examples=40, deadline=None)
@given(seed=seeds, tq=dims, tk=dims, garbage=st.sampled_from([np.nan, np.inf, -np.inf, 1e38, 0.0]),
       causal=st.sampled_from([False, True, "bottom_right"]))
def test_results_do_not_depend_on_what_padding_holds(seed, tq, tk, garbage, causal):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((3, 2, tq, 4)), rng.standard_normal((3, 2, tk, 4)), rng.standard_normal((3, 2, tk, 5))
    lens = rng.integers(0, tk + 1, size=3)
    k2, v2 = k.copy(), v.copy()
    for b, n in enumerate(lens):
        k2[b, :, n:] = garbage
        v2[b, :, n:] = garbage
    out, lse = qkv.attention(q, k, v, kv_lengths=lens, causal=causal, return_lse=True)
    out2, lse2 = qkv.attention(q, k2, v2, kv_lengths=lens, causal=causal, return_lse=True)
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(lse, lse2)
    dout = rng.standard_normal(out.shape)
    g1 = qkv.attention_backward(dout, q, k, v, out, lse, kv_lengths=lens, causal=causal)
    g2 = qkv.attention_backward(dout, q, k2, v2, out2, lse2, kv_lengths=lens, causal=causal)
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(a, b)


def test_the_texts_batched_shapes():
    """S036 §6.1: X (B, T, d_model), W (d_model, d_k) -> weights (B, T, T), output (B, T, d_v)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 6, 16))
    w_q, w_k, w_v = (rng.standard_normal((16, 4)) for _ in range(3))
    out, weights = qkv.attention(x @ w_q, x @ w_k, x @ w_v, return_weights=True)
    assert out.shape == (3, 6, 4) and weights.shape == (3, 6, 6)
    for b in range(3):  # each batch item is the single-sequence case
        np.testing.assert_allclose(out[b], qkv.attention(x[b] @ w_q, x[b] @ w_k, x[b] @ w_v), rtol=1e-12)


def test_cross_attention_shapes():
    """S036 §8: queries from the decoder (T_dec), keys and values from the encoder (T_enc)."""
    rng = np.random.default_rng(1)
    dec, enc = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 11, 8))
    out, w = qkv.attention(dec, enc, enc, return_weights=True)
    assert out.shape == (2, 3, 8) and w.shape == (2, 3, 11)


def test_gqa_backward_with_an_empty_batch():
    # B = 0 with grouped heads: the per-group sum cannot infer its head axis from size 0
    q, k = np.zeros((0, 4, 5, 3)), np.zeros((0, 2, 6, 3))
    for method in ("reference", "flash"):
        out, lse = qkv.attention(q, k, k, gqa=True, return_lse=True, method=method)
        grads = qkv.attention_backward(out, q, k, k, out, lse, gqa=True, method=method)
        assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
