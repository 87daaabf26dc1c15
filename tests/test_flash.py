"""The tiled kernel (qkv.kernels.flash) against the dense float64 reference, over every option.

Small tiles are passed for the randomized grid, so that tiny problems still cross many
query blocks, key blocks and masked-out tiles; the awkward sizes (T = 97, 1025; D = 59,
128) run with the real tile sizes.
"""
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest

import qkv
from qkv import api, threads
from qkv.kernels import flash
from qkv.kernels.flash import forward_kernel

CAUSALS = [False, True, "bottom_right"]
SMALL = flash.Tiles(rows=8, scratch=128, bwd_rows=8, bwd_keys=16, stack_rows=4)  # key chunks of 16


def tiled(tiles):
    """The tiled kernel with these tile sizes, for the calls it is handed to."""
    return SimpleNamespace(forward=partial(flash.forward, tiles=tiles),
                           backward=partial(flash.backward, tiles=tiles))


@pytest.fixture
def spy(monkeypatch):
    """Counts what the forward ran: ``bound`` tries, ``bound_redo`` (it gave up), ``exact``
    calls, and the rows of each exact call."""
    seen = {"bound": 0, "bound_redo": 0, "exact": 0, "exact_rows": []}
    real_bound, real_exact = forward_kernel._fwd_bound, forward_kernel._fwd_exact

    def bound(*a, **kw):
        res = real_bound(*a, **kw)
        seen["bound"] += 1
        seen["bound_redo"] += res is None
        return res

    def exact(qs, *a, **kw):
        seen["exact"] += 1
        seen["exact_rows"].append(qs.shape[0])
        return real_exact(qs, *a, **kw)

    monkeypatch.setattr(forward_kernel, "_fwd_bound", bound)
    monkeypatch.setattr(forward_kernel, "_fwd_exact", exact)
    return seen


def _random_options(rng, b, hq, tq, tk):
    """A random pick of every mask/bias option of the contract (some may be None)."""
    opts = {}
    causal = CAUSALS[rng.integers(3)]
    if causal:
        opts["causal"] = causal
    if rng.random() < 0.4:
        left = None if rng.random() < 0.3 else int(rng.integers(0, 12))
        right = 0 if causal else (None if rng.random() < 0.3 else int(rng.integers(0, 12)))
        opts["window"] = (left, right)
    if rng.random() < 0.4:
        opts["kv_lengths"] = rng.integers(0, tk + 1, size=b)
    if rng.random() < 0.35:
        shape = (b if rng.random() < 0.5 else 1, hq if rng.random() < 0.5 else 1, tq, tk)
        mask = rng.random(shape) < 0.75
        mask[..., rng.integers(tq), :] = False          # a row that sees nothing
        opts["mask"] = mask
    if rng.random() < 0.3:
        bias = rng.standard_normal((1 if rng.random() < 0.5 else b, hq, tq, tk))
        bias[rng.random(bias.shape) < 0.1] = -np.inf
        opts["bias"] = bias
    if rng.random() < 0.3:
        opts["alibi"] = rng.uniform(-0.3, 0.5, size=hq)   # negative slopes too
    return opts


def _case(seed):
    rng = np.random.default_rng(seed)
    b = int(rng.integers(1, 3))
    layout = ["mha", "gqa", "mqa", "broadcast"][seed % 4]
    hkv = {"mha": 2, "gqa": 2, "mqa": 1, "broadcast": 3}[layout]
    hq = {"mha": 2, "gqa": 6, "mqa": 4, "broadcast": 3}[layout]
    tq = int(rng.choice([1, 2, 9, 31, 40]))
    tk = int(rng.choice([1, 5, 16, 33, 47]))
    d = int(rng.choice([3, 8, 13]))
    dv = int(rng.choice([d, 5]))
    q = rng.standard_normal((b, hq, tq, d))
    k = rng.standard_normal((b, hkv, tk, d))
    v = rng.standard_normal((b, hkv, tk, dv))
    if layout == "broadcast":  # k and v shared over the batch, q over the heads
        k, v, q = k[:1], v[:1], q[:, :1]
    opts = _random_options(rng, b, hq, tq, tk)
    if "kv_lengths" in opts and layout != "broadcast":  # what lies past a length must never be read
        for i, n in enumerate(opts["kv_lengths"]):
            k[i, :, n:] = np.nan
            v[i, :, n:] = np.nan
    opts["gqa"] = layout in ("gqa", "mqa")
    if rng.random() < 0.3:
        opts["scale"] = float(rng.uniform(0.05, 2.0))
    return q, k, v, opts


def _both(q, k, v, dout, opts, method, tiles=None):
    """out, lse and (dq, dk, dv) through the public API, or with ``tiles`` through its steps
    (the same checks and sum-back) with the tiled kernel at those sizes."""
    if tiles is None:
        out, lse = qkv.attention(q, k, v, return_lse=True, method=method, **opts)
        grads = qkv.attention_backward(dout, q, k, v, out, lse, method=method, **opts)
        return out, lse, grads
    prob, kern = api._prepare(q, k, v, **opts), tiled(tiles)
    out, lse = api._forward(prob, kern, return_lse=True, return_weights=False)
    return out, lse, api._backward(prob, kern, api._saved(prob, dout, out, lse))


@pytest.mark.parametrize("seed", range(160))
def test_flash_matches_reference_on_random_options(seed):
    q, k, v, opts = _case(seed)
    out_r, lse_r = qkv.attention(q, k, v, return_lse=True, method="reference", **opts)
    dout = np.random.default_rng(seed + 1000).standard_normal(out_r.shape)
    ref = _both(q, k, v, dout, opts, "reference")
    got = _both(q, k, v, dout, opts, "flash", tiles=SMALL)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-9, atol=1e-11)
    np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(ref[1]))
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-9, atol=1e-11)
    for g, r, name in zip(got[2], ref[2], "qkv"):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert np.isfinite(g).all(), f"d{name} has NaN/inf"
        np.testing.assert_allclose(g, r, rtol=1e-8, atol=1e-10, err_msg=f"d{name}")


def _err(x, ref):
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref))


@pytest.mark.parametrize("t,d,causal", [(1, 59, False), (97, 59, True), (97, 128, "bottom_right"),
                                         (1025, 59, False), (1025, 128, True)])
def test_float32_error_at_most_twice_dense_float32(t, d, causal):
    """DESIGN.md's budget: float32 flash errs <= 2x what float32 dense errs, vs float64."""
    rng = np.random.default_rng(t * 1000 + d)
    q, k, v, dout = (rng.standard_normal((1, 2, t, d)) for _ in range(4))
    ref = _both(q, k, v, dout, {"causal": causal}, "reference")
    f32 = [x.astype(np.float32) for x in (q, k, v, dout)]
    dense = _both(*f32, {"causal": causal}, "reference")
    fast = _both(*f32, {"causal": causal}, "flash")
    eps = np.finfo(np.float32).eps
    for name, i, j in [("out", 0, None), ("dq", 2, 0), ("dk", 2, 1), ("dv", 2, 2)]:
        r = ref[i] if j is None else ref[i][j]
        e_dense = _err(dense[i] if j is None else dense[i][j], r)
        e_fast = _err(fast[i] if j is None else fast[i][j], r)
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
    ref = _both(q, k, v, dout, {"causal": True}, "reference")
    got = _both(q, k, v, dout, {"causal": True}, "flash")
    assert got[0].dtype == np.float16 and got[1].dtype == np.float32
    np.testing.assert_allclose(got[0].astype(np.float32), ref[0].astype(np.float32), atol=2e-3)
    for g, r in zip(got[2], ref[2]):
        assert g.dtype == np.float16
        np.testing.assert_allclose(g.astype(np.float32), r.astype(np.float32), atol=5e-3)


@pytest.mark.parametrize("causal", CAUSALS)
def test_decode_one_query_against_many_keys_gqa(causal, spy):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 8, 1, 32))
    k = rng.standard_normal((2, 2, 300, 32))
    v = rng.standard_normal((2, 2, 300, 24))
    opts = {"gqa": True, "causal": causal, "kv_lengths": np.array([300, 123])}
    k[1, :, 123:] = np.nan
    dout = rng.standard_normal((2, 8, 1, 24))
    ref = _both(q, k, v, dout, opts, "reference")
    got = _both(q, k, v, dout, opts, "flash")
    for g, r in zip([got[0], got[1], *got[2]], [ref[0], ref[1], *ref[2]]):
        np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-12)
    # one query, 4 query heads stacked per kv head: the matrix-vector (decode) path ran
    assert spy["exact"] > 0 and max(spy["exact_rows"]) <= flash.Tiles().thin_rows


def test_rows_and_tiles_that_see_nothing():
    """kv_lengths 0, a fully-False mask row, a window that misses every key, and
    bottom-right causal with Tq > Tk: out 0, lse -inf, gradients 0, no NaN, no warning."""
    rng = np.random.default_rng(11)
    q = rng.standard_normal((3, 2, 20, 8))
    k = rng.standard_normal((3, 2, 12, 8))
    v = rng.standard_normal((3, 2, 12, 8))
    k[0], v[0] = np.nan, np.nan                       # batch 0 has no keys at all
    mask = np.ones((3, 2, 20, 12), bool)
    mask[1, 1, 5] = False
    opts = {"kv_lengths": np.array([0, 12, 7]), "mask": mask, "causal": "bottom_right"}
    dout = rng.standard_normal((3, 2, 20, 8))
    out, lse, (dq, dk, dv) = _both(q, k, v, dout, opts, "flash", tiles=SMALL)
    ref = _both(q, k, v, dout, opts, "reference")
    assert np.isneginf(lse[0]).all() and (out[0] == 0).all()
    assert np.isneginf(lse[1, 1, 5]) and (out[1, 1, 5] == 0).all()
    assert np.isneginf(lse[:, :, :8]).all()          # bottom-right, Tq - Tk = 8 rows see nothing
    assert (dq[0] == 0).all() and (dk[0] == 0).all() and (dv[0] == 0).all()
    assert (dk[2, :, 7:] == 0).all()
    for g, r in zip([out, lse, dq, dk, dv], [ref[0], ref[1], *ref[2]]):
        assert not np.isnan(g).any()
        np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-12)
    # a window far to the right of every query: all rows empty
    out_w, lse_w = qkv.attention(q[1:], k[1:], v[1:], window=(0, None), causal=False,
                                 mask=np.zeros((20, 12), bool), return_lse=True, method="flash")
    assert (out_w == 0).all() and np.isneginf(lse_w).all()


@pytest.mark.parametrize("tq", [3, 40])
def test_gqa_without_a_batch_axis_reads_kv_lengths_per_query_head(tq):
    """3-D gqa input (Hq, Tq, D): the first leading axis is the head axis, so kv_lengths
    (Hq,) differs between query heads that share a kv head (and may be stacked)."""
    rng = np.random.default_rng(13)
    q = rng.standard_normal((6, tq, 8))
    k = rng.standard_normal((2, 31, 8))
    v = rng.standard_normal((2, 31, 5))
    opts = {"gqa": True, "causal": "bottom_right", "kv_lengths": np.array([31, 0, 4, 9, 31, 2])}
    dout = rng.standard_normal((6, tq, 5))
    ref = _both(q, k, v, dout, opts, "reference")
    got = _both(q, k, v, dout, opts, "flash", tiles=SMALL)
    for g, r in zip([got[0], got[1], *got[2]], [ref[0], ref[1], *ref[2]]):
        np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_input_is_nan_not_a_row_that_saw_nothing(dtype):
    """A NaN in q makes its row's out and lse NaN (as in the reference), not lse -inf, which
    would mark the row empty and silently zero its gradient."""
    rng = np.random.default_rng(14)
    q, k, v, dout = (rng.standard_normal((1, 2, 40, 8)).astype(dtype) for _ in range(4))
    q[0, 1, 7, 3] = np.nan
    ref = _both(q, k, v, dout, {}, "reference")
    got = _both(q, k, v, dout, {}, "flash")
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
def test_huge_scores_take_the_exact_path(big, spy):
    """Scores of ±1e4: the bound is loose (or overflows exp), rows are redone exactly."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 70, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 70, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 70, 8)).astype(np.float32)
    bias = np.full((70, 70), 0.0, np.float32)
    bias[:, :3] = big
    for opts in [{"scale": abs(big)}, {"bias": bias}, {"alibi": np.array([50.0, -50.0])}]:
        ref = qkv.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                            return_lse=True, method="reference", **opts)
        dense = qkv.attention(q, k, v, return_lse=True, method="reference", **opts)
        tried, redone, exact = spy["bound"], spy["bound_redo"], spy["exact"]
        got = qkv.attention(q, k, v, return_lse=True, method="flash", **opts)
        assert spy["exact"] > exact, opts  # (the alibi head with slope 50 sees scores near 0)
        if "scale" in opts:  # every row's scores are huge: whatever the bound tried, it redid
            assert spy["bound"] - tried == spy["bound_redo"] - redone
        assert np.isfinite(got[0]).all() and np.isfinite(got[1]).all()
        eps = np.finfo(np.float32).eps
        for i in (0, 1):  # scores of 1e4 carry float32 rounding of ~1e-3: the budget is dense's
            assert _err(got[i], ref[i]) <= 2 * _err(dense[i], ref[i]) + 4 * eps * np.linalg.norm(ref[i])


def test_same_answer_for_any_thread_count(monkeypatch):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 4, 300, 16)).astype(np.float32)
    k = rng.standard_normal((2, 2, 700, 16)).astype(np.float32)
    v = rng.standard_normal((2, 2, 700, 16)).astype(np.float32)
    dout = rng.standard_normal((2, 4, 300, 16)).astype(np.float32)
    results, sizes = [], []
    real_pool = threads.pool
    monkeypatch.setattr(threads, "pool", lambda n: sizes.append(n) or real_pool(n))
    try:
        for n in (1, 2, 3):
            qkv.set_num_threads(n)
            assert qkv.get_num_threads() == n
            results.append(_both(q, k, v, dout, {"gqa": True, "causal": "bottom_right"}, "flash"))
            results.append(_both(q, k, v, dout, {"gqa": True, "causal": "bottom_right"}, "flash"))
    finally:
        qkv.set_num_threads(None)
    assert set(sizes) == {2, 3}  # the tiles really went to 2 and 3 threads (1: the calling thread)
    first = results[0]
    for res in results[1:]:
        np.testing.assert_array_equal(res[0], first[0])      # forward tiles are disjoint: same bits
        np.testing.assert_array_equal(res[1], first[1])
        for g, f in zip(res[2], first[2]):
            np.testing.assert_allclose(g, f, rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0::2], results[1::2]):           # a given count: the same bits each run
        for g, f in zip(a[2], b[2]):
            np.testing.assert_array_equal(g, f)


def test_set_num_threads_checks_its_argument():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(qkv.ShapeError, match="num_threads"):
            qkv.set_num_threads(bad)
    assert qkv.get_num_threads() >= 1


def test_auto_and_weights_dispatch(spy):
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 200, 16)) for _ in range(3))
    out_a, w = qkv.attention(q, k, v, causal=True, return_weights=True, method="auto")
    assert spy["bound"] + spy["exact"] == 0  # 2·200·200 entries: below AUTO_FLASH_MIN, the dense path
    out_f, lse_f, w_f = qkv.attention(q, k, v, causal=True, return_lse=True, return_weights=True,
                                      method="flash")
    assert spy["bound"] + spy["exact"] > 0   # out and lse from the tiled kernel, weights beside
    out_r, w_r = qkv.attention(q, k, v, causal=True, return_weights=True, method="reference")
    np.testing.assert_allclose(out_a, out_r, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out_f, out_r, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(w_f, w_r, rtol=1e-12)
    np.testing.assert_allclose(w, w_r, rtol=1e-12)
    with pytest.raises(qkv.ShapeError, match="method"):
        qkv.attention(q, k, v, method="fast")


def test_flash_never_makes_a_tq_by_tk_array():
    """Peak extra memory of forward+backward stays O(T·D): far below one (T, T) matrix."""
    import tracemalloc

    rng = np.random.default_rng(0)
    t, d = 2048, 32
    q, k, v, dout = (rng.standard_normal((1, t, d)).astype(np.float32) for _ in range(4))
    qkv.set_num_threads(1)
    try:
        tracemalloc.start()
        out, lse = qkv.attention(q, k, v, causal=True, return_lse=True, method="flash")
        qkv.attention_backward(dout, q, k, v, out, lse, causal=True, method="flash")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        qkv.set_num_threads(None)
    assert peak < t * t * 4 / 2, peak  # one float32 (T, T) score matrix is 16 MiB


def test_auto_picks_flash_above_the_measured_size(monkeypatch):
    import importlib

    dispatch = importlib.import_module("qkv.api")
    calls = []
    real = flash.forward
    monkeypatch.setattr(flash, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rng = np.random.default_rng(8)
    small = rng.standard_normal((1, 2, 64, 8))
    qkv.attention(small, small, small, method="auto")
    assert calls == []
    side = int(np.ceil(np.sqrt(dispatch.AUTO_FLASH_MIN / 2)))
    big = rng.standard_normal((1, 2, side, 8))
    qkv.attention(big, big, big, method="auto")
    assert calls == [1]


@pytest.mark.parametrize("junk", [np.nan, np.inf, 1e30])
def test_padding_past_kv_lengths_is_never_read(junk):
    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 2, 64, 16)).astype(np.float32)
    k = rng.standard_normal((2, 2, 80, 16)).astype(np.float32)
    v = rng.standard_normal((2, 2, 80, 16)).astype(np.float32)
    lengths = np.array([50, 80])
    clean = qkv.attention(q, k[:, :, :80], v, kv_lengths=lengths, causal="bottom_right", method="flash")
    k[0, :, 50:] = junk
    v[0, :, 50:] = junk
    out, lse = qkv.attention(q, k, v, kv_lengths=lengths, causal="bottom_right", return_lse=True,
                             method="flash")
    np.testing.assert_array_equal(out, clean)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = qkv.attention_backward(dout, q, k, v, out, lse, kv_lengths=lengths,
                                        causal="bottom_right", method="flash")
    assert np.isfinite(dq).all() and (dk[0, :, 50:] == 0).all() and (dv[0, :, 50:] == 0).all()


def _blas_threads():
    from threadpoolctl import threadpool_info
    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


def test_blas_setting_is_restored_and_concurrent_callers_agree():
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((2, 2, 300, 16)).astype(np.float32) for _ in range(3))
    before = _blas_threads()
    want = qkv.attention(q, k, v, causal=True, method="flash")
    assert _blas_threads() == before
    with ThreadPoolExecutor(3) as pool:  # worker threads, alone and side by side
        outs = list(pool.map(lambda _: qkv.attention(q, k, v, causal=True, method="flash"), range(6)))
        small = [x[:, :, :40] for x in (q, k, v)]  # below the size that hands out tiles
        alone = qkv.attention(*small, causal=True, method="flash")
        beside = list(pool.map(lambda _: qkv.attention(*small, causal=True, method="flash"), range(6)))
    for out in outs:
        np.testing.assert_array_equal(out, want)
    for out in beside:
        np.testing.assert_array_equal(out, alone)
    assert _blas_threads() == before  # the last caller, whichever thread, restored it
