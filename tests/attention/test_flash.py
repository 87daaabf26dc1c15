"""The tiled kernel (qkv.kernels.flash) against the dense float64 reference, over every option;
its paths, threads, dispatch and memory. Numerics at the edges: test_flash_numerics.py.

Small tiles are passed for the randomized grid, so that tiny problems still cross many
query blocks, key blocks and masked-out tiles.
"""
import numpy as np
import pytest
from flash_helpers import SMALL, both, spy  # noqa: F401 (spy is a fixture)

import qkv
from qkv import api, threads
from qkv.kernels import flash

CAUSALS = [False, True, "bottom_right"]


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


@pytest.mark.parametrize("seed", range(160))
def test_flash_matches_reference_on_random_options(seed):
    q, k, v, opts = _case(seed)
    out_r, lse_r = qkv.attention(q, k, v, return_lse=True, method="reference", **opts)
    dout = np.random.default_rng(seed + 1000).standard_normal(out_r.shape)
    ref = both(q, k, v, dout, opts, "reference")
    got = both(q, k, v, dout, opts, "flash", tiles=SMALL)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-9, atol=1e-11)
    np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(ref[1]))
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-9, atol=1e-11)
    for g, r, name in zip(got[2], ref[2], "qkv"):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert np.isfinite(g).all(), f"d{name} has NaN/inf"
        np.testing.assert_allclose(g, r, rtol=1e-8, atol=1e-10, err_msg=f"d{name}")


@pytest.mark.parametrize("causal", CAUSALS)
def test_decode_one_query_against_many_keys_gqa(causal, spy):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 8, 1, 32))
    k = rng.standard_normal((2, 2, 300, 32))
    v = rng.standard_normal((2, 2, 300, 24))
    opts = {"gqa": True, "causal": causal, "kv_lengths": np.array([300, 123])}
    k[1, :, 123:] = np.nan
    dout = rng.standard_normal((2, 8, 1, 24))
    ref = both(q, k, v, dout, opts, "reference")
    got = both(q, k, v, dout, opts, "flash")
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
    spec = api.prepare(q, k, v, **opts).spec       # the premise: whole tiles see nothing
    empty = [q0 for q0 in range(0, 20, SMALL.rows) if not spec.segments(q0, q0 + SMALL.rows, 0, 12, batch=2)]
    assert empty == [0] and spec.query_range(7, 12, batch=2) == (0, 0)
    out, lse, (dq, dk, dv) = both(q, k, v, dout, opts, "flash", tiles=SMALL)
    ref = both(q, k, v, dout, opts, "reference")
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
    ref = both(q, k, v, dout, opts, "reference")
    got = both(q, k, v, dout, opts, "flash", tiles=SMALL)
    for g, r in zip([got[0], got[1], *got[2]], [ref[0], ref[1], *ref[2]]):
        np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-12)


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
            results.append(both(q, k, v, dout, {"gqa": True, "causal": "bottom_right"}, "flash"))
            results.append(both(q, k, v, dout, {"gqa": True, "causal": "bottom_right"}, "flash"))
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


@pytest.mark.parametrize("opts", [dict(causal=True), dict(causal=True, align="bottom_right", window=40),
                                  dict(window=(9, 30), align="bottom_right", alibi=np.array([0.3, 0.1]))])
def test_masked_diagonals_are_split_into_row_blocks(monkeypatch, opts):
    """The forward's bound path computes a masked diagonal by narrower row blocks, each only
    over the keys it may see: fewer score entries than the whole tiles, the same answer."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 2, 200, 16)).astype(np.float32) for _ in range(3))
    area = []
    real = flash.bound_tiles.run

    def counted(qs, kk, vv, m, acc, l, spec, heads, q0, q1, pieces, *rest):
        for a, b, (r0, r1, _) in pieces:
            area.append(((qs.shape[0] if (r0, r1) == (q0, q1) else r1 - r0)) * (b - a))
        return real(qs, kk, vv, m, acc, l, spec, heads, q0, q1, pieces, *rest)

    monkeypatch.setattr(flash.bound_tiles, "run", counted)
    want = qkv.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                         method="reference", **opts)
    got = {}
    for name, tiles in (("split", flash.Tiles(rows=96, diagonal_rows=16)),
                        ("whole", flash.Tiles(rows=96, diagonal_rows=96))):
        area.clear()
        prob = api.prepare(q, k, v, **opts)
        out, _, _ = flash.forward(prob.q, prob.k, prob.v, prob.spec, prob.scale, prob.group, tiles=tiles)
        got[name] = (out, sum(area))
        np.testing.assert_allclose(out, want, atol=2e-6)
    assert got["split"][1] < 0.85 * got["whole"][1], (got["split"][1], got["whole"][1])


def test_float32_decoding_reads_k_and_v_once_compiled(monkeypatch):
    """float32 decoding rows (<= thin_rows) take the compiled passes over K and V where numba
    is there (QKV_JIT=0: BLAS's matrix-vector products); both within float32's error of the
    float64 answer, padding (NaN past kv_lengths) never read."""
    from qkv import jit
    rng = np.random.default_rng(8)
    q = rng.standard_normal((2, 8, 1, 64)).astype(np.float32)
    k = rng.standard_normal((2, 2, 700, 64)).astype(np.float32)
    v = rng.standard_normal((2, 2, 700, 48)).astype(np.float32)
    kv_lengths = np.array([700, 333])
    k[1, :, 333:] = np.nan
    v[1, :, 333:] = np.nan
    calls = []
    c = jit.flash()
    if c is not None:
        for name in ("thin_scores", "thin_values"):
            real = getattr(c, name)
            monkeypatch.setattr(c, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    got = qkv.attention(q, k, v, gqa=True, kv_lengths=kv_lengths, method="flash")
    want = qkv.attention(*(x.astype(np.float64) for x in (q, k, v)), gqa=True, kv_lengths=kv_lengths,
                         method="reference")
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    assert got.dtype == np.float32
    assert (set(calls) == {"thin_scores", "thin_values"}) == (c is not None)
