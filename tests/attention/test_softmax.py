import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import qkv
from qkv.numerics import merge_partials


def test_softmax_matches_the_definition_on_small_numbers():
    x = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    e = np.exp(x)
    np.testing.assert_allclose(qkv.softmax(x), e / e.sum(-1, keepdims=True), rtol=1e-15)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_softmax_is_stable_for_huge_scores(dtype):
    big = 1e4 if dtype != np.float16 else 6e4
    x = np.array([big, big - 1.0, -big], dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w = qkv.softmax(x)
        lse = qkv.logsumexp(x)
    assert w.dtype == dtype
    assert np.isfinite(w).all() and np.isfinite(lse)
    x64 = x.astype(np.float64)  # the values as stored (float16 rounds big - 1)
    ref = np.exp(x64 - x64.max()) / np.exp(x64 - x64.max()).sum()
    np.testing.assert_allclose(w.astype(np.float64), ref, atol=1e-3 if dtype == np.float16 else 1e-6)


def test_all_minus_inf_rows_give_zero_weights_and_minus_inf_lse_without_warning():
    x = np.array([[-np.inf, -np.inf, -np.inf], [0.0, -np.inf, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w = qkv.softmax(x)
        lse = qkv.logsumexp(x)
    np.testing.assert_array_equal(w[0], 0.0)
    np.testing.assert_allclose(w[1], [0.5, 0.0, 0.5])
    assert lse[0] == -np.inf
    np.testing.assert_allclose(lse[1], np.log(2.0))


def test_an_empty_row_is_a_row_that_sees_nothing():
    x = np.zeros((2, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert qkv.softmax(x).shape == (2, 0)
        np.testing.assert_array_equal(qkv.logsumexp(x), [-np.inf, -np.inf])


def test_softmax_axis_and_keepdims():
    x = np.arange(6.0).reshape(2, 3)
    np.testing.assert_allclose(qkv.softmax(x, axis=0).sum(0), 1.0)
    assert qkv.logsumexp(x, axis=0, keepdims=True).shape == (1, 3)


def test_softmax_refuses_bad_input():
    with pytest.raises(qkv.ShapeError, match="axis"):
        qkv.softmax(np.zeros((2, 3)), axis=2)
    with pytest.raises(qkv.ShapeError, match="axis"):
        qkv.logsumexp(np.zeros((2, 3)), axis=True)
    with pytest.raises(qkv.ShapeError, match="x must be a real floating array"):
        qkv.softmax(np.arange(3))


def test_nan_is_not_repaired():
    w = qkv.softmax(np.array([[0.0, np.nan], [0.0, 1.0]]))
    assert np.isnan(w[0]).all() and np.isfinite(w[1]).all()


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float64, hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=6),
                  elements=st.floats(-1e4, 1e4) | st.just(-np.inf)))
def test_softmax_rows_sum_to_one_or_are_all_zero(x):
    w = qkv.softmax(x)
    s = w.sum(-1)
    dead = np.all(x == -np.inf, axis=-1)
    np.testing.assert_allclose(s[~dead], 1.0, rtol=1e-12)
    np.testing.assert_array_equal(s[dead], 0.0)
    assert (w >= 0).all()
    lse = qkv.logsumexp(x)
    assert np.isfinite(lse[~dead]).all() and (lse[dead] == -np.inf).all()


def test_merge_partials_equals_attention_over_the_union():
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(5, 8)), rng.normal(size=(12, 8)), rng.normal(size=(12, 3))
    full, lse = qkv.attention(q, k, v, return_lse=True, method="reference")
    a, la = qkv.attention(q, k[:7], v[:7], return_lse=True, method="reference")
    b, lb = qkv.attention(q, k[7:], v[7:], return_lse=True, method="reference")
    out, lse2 = merge_partials(a, la, b, lb)
    np.testing.assert_allclose(out, full, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse2, lse, rtol=1e-12)


def test_merge_partials_with_an_empty_side():
    out = np.ones((2, 3))
    lse = np.array([0.5, -np.inf])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merged, l2 = merge_partials(out, lse, np.zeros((2, 3)), np.array([-np.inf, -np.inf]))
    np.testing.assert_allclose(merged[0], 1.0)
    np.testing.assert_array_equal(merged[1], 0.0)
    np.testing.assert_array_equal(l2, [0.5, -np.inf])
