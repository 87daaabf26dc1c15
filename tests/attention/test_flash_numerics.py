"""The tiled kernel's numerics: the float32 error budget, float16, NaN, and the edges of the
range (large values under the fixed offset, scores of 1e4 and beyond, a float32 lse that
cannot hold the normaliser, biases at finfo.min). The random sweep of all of it is
test_adversarial.py."""
import numpy as np
import pytest
from flash_helpers import SMALL, both, err, spy, tiled  # noqa: F401 (spy is a fixture)
import peaked_oracle

import qkv
from qkv import api

import oracle
from qkv.kernels.flash import forward_kernel

CAUSALS = [False, True, "bottom_right"]


@pytest.mark.parametrize("t,d,causal", [(1, 59, False), (97, 59, True), (97, 128, "bottom_right"),
                                         (1025, 59, False), (1025, 128, True)])
def test_float32_error_at_most_twice_dense_float32(t, d, causal):
    """DESIGN.md's budget: float32 flash errs <= 2x what float32 dense errs, vs float64."""
    rng = np.random.default_rng(t * 1000 + d)
    q, k, v, dout = (rng.standard_normal((1, 2, t, d)) for _ in range(4))
    ref = both(q, k, v, dout, {"causal": causal}, "reference")
    f32 = [x.astype(np.float32) for x in (q, k, v, dout)]
    dense = both(*f32, {"causal": causal}, "reference")
    fast = both(*f32, {"causal": causal}, "flash")
    eps = np.finfo(np.float32).eps
    for name, i, j in [("out", 0, None), ("dq", 2, 0), ("dk", 2, 1), ("dv", 2, 2)]:
        r = ref[i] if j is None else ref[i][j]
        e_dense = err(dense[i] if j is None else dense[i][j], r)
        e_fast = err(fast[i] if j is None else fast[i][j], r)
        if t == 1 and name in ("dq", "dk"):
            # one key: softmax is constant, so dq = dk = 0 exactly and both paths show only
            # the rounding of dP - delta; check that it is rounding-sized instead of a ratio
            assert e_fast <= 8 * eps * np.linalg.norm(dout) * np.abs(k).max() * np.abs(v).max()
            continue
        # floor: where dense is exact by construction (T = 1: P = 1), allow a few ulps
        assert e_fast <= 2 * e_dense + 4 * eps * np.linalg.norm(r), (name, e_fast, e_dense)
    assert fast[0].dtype == np.float32 and fast[1].dtype == np.float32


def test_float16_computes_in_float32():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 3, 40, 16)).astype(np.float16) for _ in range(3))
    dout = rng.standard_normal((2, 3, 40, 16)).astype(np.float16)
    ref = both(q, k, v, dout, {"causal": True}, "reference")
    got = both(q, k, v, dout, {"causal": True}, "flash")
    assert got[0].dtype == np.float16 and got[1].dtype == np.float32
    np.testing.assert_allclose(got[0].astype(np.float32), ref[0].astype(np.float32), atol=2e-3)
    for g, r in zip(got[2], ref[2]):
        assert g.dtype == np.float16
        np.testing.assert_allclose(g.astype(np.float32), r.astype(np.float32), atol=5e-3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_input_is_nan_not_a_row_that_saw_nothing(dtype):
    """A NaN in q makes its row's out and lse NaN (as in the reference), not lse -inf, which
    would mark the row empty and silently zero its gradient."""
    rng = np.random.default_rng(14)
    q, k, v, dout = (rng.standard_normal((1, 2, 40, 8)).astype(dtype) for _ in range(4))
    q[0, 1, 7, 3] = np.nan
    ref = both(q, k, v, dout, {}, "reference")
    got = both(q, k, v, dout, {}, "flash")
    for g, r in ((got[0], ref[0]), (got[1], ref[1]), (got[2][0], ref[2][0])):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(r))
        assert np.isnan(g[0, 1, 7]).all()
        np.testing.assert_allclose(g[~np.isnan(r)], r[~np.isnan(r)], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype,score,size", [(np.float32, 55.0, 1e15), (np.float64, 290.0, 1e183)])
def test_large_values_do_not_overflow_the_fixed_offset(dtype, score, size, spy):
    """The fixed offset lets exp reach 2^C; times a large but finite value that overflowed
    the accumulator to ±inf where the reference (weights <= 1) is finite."""
    rng = np.random.default_rng(15)
    q = np.zeros((1, 1, 64, 16), dtype)
    q[..., 0] = np.sqrt(score * 4)  # every score is `score` with the default scale 1/4
    v = (rng.standard_normal((1, 1, 64, 16)) * size).astype(dtype)
    ref = qkv.attention(q, q, v, return_lse=True, method="reference")
    got = qkv.attention(q, q, v, return_lse=True, method="flash")
    assert spy["bound"] == spy["bound_redo"] > 0  # the fixed offset was tried, and redone exactly
    assert np.isfinite(got[0]).all()
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-5)


@pytest.mark.parametrize("big", [1e4, -1e4])
def test_huge_scores_take_the_precise_path(big, spy):
    """Scores of ±1e4: the bound is loose (or overflows exp); the rows are redone in float64
    (forward) and normalised by their own sums (backward), within the budget of dense float32."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 70, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 70, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 70, 8)).astype(np.float32)
    dout = rng.standard_normal((1, 2, 70, 8)).astype(np.float32)
    bias = np.full((70, 70), 0.0, np.float32)
    bias[:, :3] = big
    for opts in [{"scale": abs(big)}, {"bias": bias}, {"alibi": np.array([50.0, -50.0])}]:
        ref = both(*(x.astype(np.float64) for x in (q, k, v, dout)), opts, "reference")
        dense = both(q, k, v, dout, opts, "reference")
        precise, normalised = spy["precise"], spy["normalised"]
        got = both(q, k, v, dout, opts, "flash")
        large = bool(forward_kernel.large_rows(ref[1], 70, np.float32).any())  # False: bias -1e4 only hides keys
        assert (spy["precise"] > precise) == large and (spy["normalised"] > normalised) == large, opts
        assert large or big < 0
        assert np.isfinite(got[0]).all() and np.isfinite(got[1]).all()
        eps = np.finfo(np.float32).eps
        pairs = [(got[0], dense[0], ref[0]), (got[1], dense[1], ref[1])] + list(zip(got[2], dense[2], ref[2]))
        for g, d, r in pairs:  # scores of 1e4 carry float32 rounding of ~1e-3: the budget is dense's
            assert np.isfinite(g).all()
            assert err(g, r) <= 2 * err(d, r) + 4 * eps * np.linalg.norm(r)


@pytest.mark.parametrize("dtype,scales", [
    (np.float32, [1, 35, 350, 3500, 3.5e4, 3.5e5, 3.5e8, 3.5e20, 3e36]),
    (np.float64, [1, 3.5e3, 3.5e8, 3.5e14, 3.5e100, 3.5e300])])
def test_rows_of_p_sum_to_one_in_the_backward_at_any_scale(dtype, scales):
    """dout = 1: the sum of dv over keys is Σ_i Σ_j P_ij, which is Tq exactly. A float32 lse
    saved at |lse| = 1e4 is off by half an ulp, 5e-4: P recomputed from it summed to 48.0085
    at scale 3500 and overflowed at 3.5e8; the precise rows are normalised by their own sums."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 48, 8)).astype(dtype) for _ in range(3))
    for scale in scales:
        out, lse = qkv.attention(q, k, v, scale=scale, return_lse=True, method="flash")
        grads = qkv.attention_backward(np.ones_like(out), q, k, v, out, lse, scale=scale, method="flash")
        assert all(np.isfinite(g).all() for g in grads), scale
        assert abs(grads[2].astype(np.float64).sum(axis=-2)[0, 0, 0] - 48) <= 1e-5, scale


def test_float16_inputs_near_the_top_of_their_range():
    """float16 q, k of size ~3e4 (scores ~1e8, computed in float32): NaN in dq and inf in dv
    before; now finite and the rows of P still sum to one."""
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, 1, 48, 8)) * 7.5e3 for _ in range(2))
    q, k, v = q.astype(np.float16), k.astype(np.float16), rng.standard_normal((1, 1, 48, 8)).astype(np.float16)
    out, lse = qkv.attention(q, k, v, return_lse=True, method="flash")
    grads = qkv.attention_backward(np.ones_like(out), q, k, v, out, lse, method="flash")
    assert all(np.isfinite(g).all() for g in grads)
    assert abs(grads[2].astype(np.float64).sum(axis=-2)[0, 0, 0] - 48) <= 0.05  # float16 dv: 3 digits


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_bias_at_finfo_min_is_a_finite_score_not_a_mask(dtype, spy):
    """Hugging Face masks with finfo(dtype).min. A row all at that value sees every key
    (the softmax of its scores, lse near finfo.min); one partly at it sees the others.
    Before, flash read the overflowed base-2 bias as 'sees nothing': zeros, lse -inf, a warning."""
    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal((1, 2, 40, 8)).astype(dtype) for _ in range(4))
    bias = np.zeros((40, 40), dtype)
    bias[3] = np.finfo(dtype).min
    bias[5, 10:] = np.finfo(dtype).min
    ref = both(*(x.astype(np.float64) for x in (q, k, v, dout)), {"bias": bias.astype(np.float64)}, "reference")
    got = both(q, k, v, dout, {"bias": bias}, "flash")
    assert spy["precise"] > 0                       # the row at finfo.min took the precise path
    assert np.isfinite(got[1]).all() and (got[1][0, :, 3] < 0.99 * np.finfo(dtype).min).all()
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for g, r in zip([got[0], got[1] / np.abs(ref[1]).max(), *got[2]], [ref[0], ref[1] / np.abs(ref[1]).max(), *ref[2]]):
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol)


def _ulp_err(x, ref, size):
    """Largest element-wise error in ulps of the result's magnitude (float32), each element's
    error first reduced by 4 ulps of what it sums (``size``: Σ|terms|, the README's floor:
    dq and dk are differences, and a cancelling element errs by its terms, not its value)."""
    err = np.abs(np.asarray(x, np.float64) - ref)
    floor = 4 * np.finfo(np.float32).eps * size
    return float(np.maximum(err - floor, 0).max() / np.spacing(np.float32(np.abs(ref).max())))


@pytest.mark.parametrize("shape,causal,std", [
    *[(s, c, std) for s, c in (((1, 2, 72, 75, 47), True), ((2, 4, 130, 129, 64), False), ((1, 1, 300, 300, 16), True))
      for std in (1.0, 1.9, 4.0)],
    ((1, 4, 2048, 2048, 64), True, 1.9)])
@pytest.mark.slow
def test_float32_element_wise_error_within_twice_dense(shape, causal, std):
    """Element by element, the tiled float32 out, dq, dk and dv err at most 2x what the dense
    float32 path errs against float64 (on a floor of 4 ulps of the result, each element's
    error less 4 ulps of its Σ|terms|). Where the ulps
    had gone: P rebuilt from the float32 lse (off by half its ulp per row: dv 3-4x), delta
    from an out made with other roundings (dq 3x), and softmax sums run in float32 over
    2048 keys (out 3.4x)."""
    b, h, tq, tk, d = shape
    for seed in range(1 if tk > 1000 else 3):
        rng = np.random.default_rng(seed)
        q, k = std * rng.standard_normal((b, h, tq, d)), std * rng.standard_normal((b, h, tk, d))
        v, dout = rng.standard_normal((b, h, tk, d)), rng.standard_normal((b, h, tq, d))
        f32 = [x.astype(np.float32) for x in (q, k, v, dout)]
        f64 = [x.astype(np.float64) for x in f32]
        o, lse = qkv.attention(*f64[:3], causal=causal, return_lse=True, method="reference")
        exact = [o, *qkv.attention_backward(f64[3], *f64[:3], o, lse, causal=causal, method="reference")]
        sizes = oracle.solve(*f64, causal=causal).size
        errs = {}
        for method in ("reference", "flash"):
            o32, l32 = qkv.attention(*f32[:3], causal=causal, return_lse=True, method=method)
            got = [o32, *qkv.attention_backward(f32[3], *f32[:3], o32, l32, causal=causal, method=method)]
            errs[method] = [_ulp_err(g, e, sizes[n]) for g, e, n in zip(got, exact, ("out", "dq", "dk", "dv"))]
        for name, dense, tiled in zip(("out", "dq", "dk", "dv"), errs["reference"], errs["flash"]):
            assert tiled <= 2 * max(dense, 4.0), (name, seed, tiled, dense)


@pytest.mark.parametrize("tiles", [None, SMALL], ids=["whole-rows", "tiled-rows"])
def test_nearly_one_hot_rows_get_an_exact_delta(tiles):
    """Rows where one key holds all but ~1e-9 of the weight (causal, window 5): dq and dk err
    <= 1e-8 of the largest true entry in float64 and <= 2x dense float32 torch in float32,
    against a cancellation-free oracle, also when a row's keys span several tiles (where
    delta = rowsum(dO ∘ O) left 1.1e-5 and 4e3; torch errs 5e-6 and 0.84)."""
    pytest.importorskip("torch", reason="dense float32 torch is the float32 yardstick (the torch extra)")
    q, k, v, dout = peaked_oracle.one_hot_inputs(np.random.default_rng(7))
    opts = dict(causal=True, window=5, scale=0.625)
    want = peaked_oracle.stable_grads(dout, q, k, v, **opts)
    assert np.abs(want[0]).max() < 1e-8                           # every row nearly one-hot
    for dtype in (np.float64, np.float32):
        a = [x.astype(dtype) for x in (q, k, v, dout)]
        _, _, (dq, dk, _) = both(*a, opts, "flash", tiles)
        errs = [peaked_oracle.rel_err(g, w) for g, w in zip((dq, dk), want)]
        if dtype == np.float64:
            assert max(errs) <= 1e-8, errs
        else:
            dense = peaked_oracle.dense_float32_torch(a, opts, want)
            assert errs[0] <= 2 * dense[0] and errs[1] <= 2 * dense[1] and max(errs) <= 1e-3, (errs, dense)


def test_delta_residual_changes_only_the_peaked_rows(monkeypatch):
    """Bits: with the residual pass off, dv is the same array and dq differs only in the rows
    that peaked_rows chooses."""
    from qkv.kernels.flash import backward_kernel

    rng = np.random.default_rng(3)
    q, k, v, dout = peaked_oracle.one_hot_inputs(rng, T=40, shape=(1, 2))
    q[:, :, ::2] *= 0.2                                           # every other row: an ordinary one
    k = k.copy()
    opts = dict(causal=True, window=12, scale=0.625)
    _, _, new = both(q, k, v, dout, opts, "flash", SMALL)
    chosen = []
    real = backward_kernel.peaked_rows
    monkeypatch.setattr(backward_kernel, "peaked_rows", lambda p, n: chosen.append(real(p, n)) or p & False)
    _, _, old = both(q, k, v, dout, opts, "flash", SMALL)
    rows = chosen[0]
    assert rows.any() and not rows.all()
    assert np.array_equal(new[2], old[2])
    assert np.array_equal(new[0][~rows], old[0][~rows]) and not np.array_equal(new[0][rows], old[0][rows])


def test_nearly_one_hot_rows_with_dlse():
    """The residual leaves ``Σ_j dS_ij = dlse_i``: with a gradient on lse too, float64 dq and dk
    of rows spanning several tiles stay within 1e-8 of the largest true entry."""
    q, k, v, dout = peaked_oracle.one_hot_inputs(np.random.default_rng(8))
    dlse = 1e-9 * np.random.default_rng(9).standard_normal(q.shape[:-1])   # the size of dS_ir
    opts = dict(causal=True, window=5, scale=0.625)
    want = peaked_oracle.stable_grads(dout, q, k, v, dlse=dlse, **opts)
    prob, kern = api.prepare(q, k, v, **opts), tiled(SMALL)
    out, lse = api.Prepared(prob, kern).forward(return_lse=True)
    dq, dk, _ = api.Prepared(prob, kern).backward(dout, out, lse, dlse=dlse)
    errs = [peaked_oracle.rel_err(g, w) for g, w in zip((dq, dk), want)]
    assert max(errs) <= 1e-8, errs
