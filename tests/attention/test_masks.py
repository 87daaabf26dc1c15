"""MaskSpec: the one description of every mask option, asked about one block at a time."""
import numpy as np
import pytest
from helpers import oracle_allowed, oracle_bias
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import qkv
from qkv.masks import build_spec
from qkv.options import parse_window

LEAD = (2, 3)


def spec_and_oracle(rng, tq, tk, opts, with_lengths, with_mask):
    opts = dict(opts)
    if with_lengths:
        opts["kv_lengths"] = rng.integers(0, tk + 1, size=2)
        opts["q_lengths"] = rng.integers(0, tq + 1, size=2)
    mask = (rng.random((3, tq, tk)) < 0.8) if with_mask else None
    bias = rng.standard_normal((1, tq, tk))
    alibi = rng.random(3) if rng.random() < 0.5 else rng.random((2, 3))
    spec = build_spec(LEAD, tq, tk, mask=mask, bias=bias, alibi=alibi, **opts)
    structure = {n: opts.get(n) for n in ("causal", "align", "kv_lengths", "q_lengths")}
    ok = oracle_allowed(LEAD, tq, tk, window=opts.get("window"), chunk=opts.get("chunk"), mask=mask, **structure)
    add = oracle_bias(LEAD, tq, tk, bias=bias, alibi=alibi, **structure)
    return spec, ok, add


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), tq=st.integers(1, 12), tk=st.integers(1, 12),
       causal=st.sampled_from([False, True, "top_left", "bottom_right"]),
       align=st.sampled_from([None, "top_left", "bottom_right"]),
       window=st.none() | st.integers(0, 5) | st.tuples(st.none() | st.integers(0, 5), st.none() | st.integers(0, 5)),
       chunk=st.none() | st.integers(1, 6),
       with_lengths=st.booleans(), with_mask=st.booleans(), bq=st.integers(1, 5), bk=st.integers(1, 5))
def test_blocks_agree_with_the_dense_definition(seed, tq, tk, causal, align, window, chunk, with_lengths,
                                                with_mask, bq, bk):
    assume(not (causal and isinstance(window, tuple) and (window[1] or 0) > 0))  # a conflict: see test_errors
    assume(not (isinstance(causal, str) and align is not None and align != causal))  # a conflict too
    rng = np.random.default_rng(seed)
    opts = {"causal": causal, "align": align, "window": window, "chunk": chunk}
    spec, ok, add = spec_and_oracle(rng, tq, tk, opts, with_lengths, with_mask)
    dense = spec.allowed()
    dense = np.ones(LEAD + (tq, tk), bool) if dense is None else np.broadcast_to(dense, LEAD + (tq, tk))
    np.testing.assert_array_equal(dense, ok)
    np.testing.assert_allclose(np.broadcast_to(spec.additive(), LEAD + (tq, tk)), add, rtol=1e-12)
    for b in range(2):
        for q0 in range(0, tq, bq):
            q1 = min(q0 + bq, tq)
            real = q1 if spec.q_lengths is None else min(q1, int(spec.q_lengths[b]))
            block = ok[b, :, q0:real]                  # (H, rows, Tk): padding rows are never computed
            covered = np.zeros(tk, bool)
            for a, e, full in spec.segments(q0, q1, 0, tk, batch=b):
                covered[a:e] = True
                if full:  # every row and head sees every key of a full run
                    assert block[:, :, a:e].all(), (q0, q1, a, e)
            assert not block[:, :, ~covered].any(), "a visible key lies outside the segments"
        for k0 in range(0, tk, bk):
            k1 = min(k0 + bk, tk)
            r0, r1 = spec.query_range(k0, k1, batch=b)
            rows = np.zeros(tq, bool)
            rows[max(r0, 0):max(r1, 0)] = True
            assert not ok[b, :, ~rows, k0:k1].any(), "a row outside query_range sees a key of the block"
        for q0 in range(0, tq, bq):
            q1 = min(q0 + bq, tq)
            for h in range(3):
                part = spec.allowed(q0, q1, 0, tk, index=(b, h))
                part = np.ones((q1 - q0, tk), bool) if part is None else part
                np.testing.assert_array_equal(np.broadcast_to(part, (q1 - q0, tk)), ok[b, h, q0:q1])
                bias_part = spec.additive(q0, q1, 0, tk, index=(b, h))
                np.testing.assert_allclose(np.broadcast_to(bias_part, (q1 - q0, tk)), add[b, h, q0:q1], rtol=1e-12)


def test_structured_blocks_are_classified_exactly():
    spec = build_spec((1,), 8, 8, causal=True)
    assert spec.segments(0, 4, 4, 8, batch=0) == []                      # above the diagonal: skipped
    assert spec.segments(4, 8, 0, 4, batch=0) == [(0, 4, True)]         # below it: no mask needed
    assert spec.segments(0, 4, 0, 4, batch=0) == [(0, 1, True), (1, 4, False)]
    spec = build_spec((1,), 2, 5, causal="bottom_right")
    assert spec.offset == 3
    np.testing.assert_array_equal(spec.allowed(), [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(build_spec((1,), 2, 5, causal=True).allowed(), [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])


def test_trivial_spec_needs_no_arrays():
    spec = build_spec((2, 3), 4, 5)
    assert spec.is_trivial and spec.allowed() is None and spec.additive() is None
    assert spec.segments(0, 4, 0, 5, batch=1) == [(0, 5, True)] and spec.query_range(0, 5, batch=0) == (0, 4)


@pytest.mark.parametrize("window,expected", [(None, (None, None)), (3, (3, 0)), ((2, None), (2, None)), ([1, 4], (1, 4))])
def test_window_forms(window, expected):
    assert parse_window(window) == expected


def test_window_without_causal_is_top_left_aligned():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 4)), rng.standard_normal((6, 4)), rng.standard_normal((6, 4))
    _, w = qkv.attention(q, k, v, window=(0, 1), return_weights=True)
    assert (w[0, 2:] == 0).all() and (w[1, :1] == 0).all() and (w[1, 3:] == 0).all()
