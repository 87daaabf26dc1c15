"""The row kernel (``qkv.kernels.rows.kernel``): what ``method="auto"`` runs for float32 sequences of
up to 1024 keys with the fast extra. Judged against the float64 oracle by the differential
harness's budget, bit-identical for any thread count, and chosen only where it applies."""
import numpy as np
import pytest

import qkv
from qkv import api
from qkv.kernels.rows import kernel as rows
from qkv.threads import kernel_threads

from row_cases import MASKS, check, differential_cases, hf_gqa_layout_case, inputs, large_scores, one_hot_row

pytestmark = pytest.mark.skipif(rows._fused() is None,
                                reason="the row kernel needs the fast extra (numba) and QKV_JIT != 0")


def _check(q, k, v, dout, dlse=None, **opts) -> list:
    return check(api.ROWS, q, k, v, dout, dlse=dlse, **opts)


@pytest.mark.parametrize("opts", MASKS)
@pytest.mark.parametrize("shape", [((2, 4, 33, 16), (2, 2, 45, 16)),   # GQA, Tq < Tk
                                   ((3, 2, 50, 8), (3, 2, 20, 8)),     # Tq > Tk: bottom-right rows that see nothing
                                   ((12, 4, 64, 32), (12, 4, 64, 32))])  # nanoGPT's CPU recipe
def test_masks_and_groups_within_the_float32_budget(opts, shape):
    q, k, v, dout = inputs(*shape)
    gqa = q.shape[1] != k.shape[1]
    dlse = np.random.default_rng(1).standard_normal(q.shape[:-1]).astype(np.float32)
    assert _check(q, k, v, dout, gqa=gqa, **opts) == []
    assert _check(q, k, v, dout, dlse=dlse, gqa=gqa, **opts) == []


@pytest.mark.parametrize("scale", [4.0, 8.0, 30.0])
def test_trained_model_magnitudes_and_the_rows_that_need_their_max(scale):
    """Scores of std 16 up to ~900 (in log2 units past 2^100: the rows that subtract their
    max first), negative scale too."""
    q, k, v, dout = inputs((2, 3, 40, 16), (2, 3, 40, 16), scale=np.sqrt(scale))
    for opts in (dict(causal=True), dict(scale=-0.3), dict()):
        assert _check(q, k, v, dout, **opts) == []


@pytest.mark.parametrize("magnitude", [2e9, 4e9, 1e20, 1e30])
def test_large_finite_scores_give_the_one_hot_row(magnitude):
    """Issue 34: at 4e9 the rows that subtract their max took ``c·x - max(c·x)`` as one fused
    multiply-add, the max entry's term 0, the row NaN and lse -inf; the max is now taken of
    the stored scores, whose own difference is exactly 0."""
    q, k, v, dout = one_hot_row(magnitude)
    out, lse = qkv.attention(q, k, v, return_lse=True)
    np.testing.assert_array_equal(out[0, 0, 0], v[0, 0, 6])
    np.testing.assert_allclose(lse, magnitude, rtol=1e-6)
    assert _check(q, k, v, dout) == []


@pytest.mark.parametrize("std", [3e4, 1e6, 1e8, 1e15, 1e30])
def test_large_random_scores_within_the_float32_budget(std):
    """Scores of std 3e4 to 1e30 (forward, backward, lse, dlse; softcap and dropout too): 8 to
    543 of 1024 rows were NaN before."""
    q, k, v, dout = large_scores(std)
    dlse = np.random.default_rng(2).standard_normal(q.shape[:-1]).astype(np.float32)
    for opts in (dict(), dict(causal=True), dict(softcap=30.0), dict(dropout_p=0.3, dropout_seed=1)):
        assert _check(q, k, v, dout, dlse=dlse, **opts) == []


def test_nan_reaches_its_rows_only():
    q, k, v, _ = inputs((1, 2, 16, 8), (1, 2, 16, 8))
    q[0, 1, 5, 3] = np.nan
    out = qkv.attention(q, k, v, causal=True)
    assert np.isnan(out[0, 1, 5]).all()
    bad = np.zeros(out.shape[:-1], bool)
    bad[0, 1, 5] = True
    assert np.isfinite(out[~bad]).all()


def test_the_differential_cases_it_takes():
    """The harness's random float32 problems (lengths, extreme values, every alignment) that the
    row kernel takes: all within the budget, and enough of them to mean something."""
    taken, fails = differential_cases(api.ROWS)
    assert fails == []
    assert taken >= 20


def test_the_same_bits_for_any_thread_count():
    q, k, v, dout = inputs((8, 8, 97, 24), (8, 4, 83, 24))
    runs = []
    for threads in (1, 2, 3):
        with kernel_threads(threads):
            out, lse = qkv.attention(q, k, v, gqa=True, causal="bottom_right", return_lse=True)
            runs.append((out, lse) + qkv.attention_backward(dout, q, k, v, out, lse, gqa=True, causal="bottom_right"))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("drop", [False, True])
def test_the_row_pass_gives_a_row_its_bits_in_a_group_of_four_or_alone(drop):
    """The compiled forward pass takes four rows that see the same keys in one loop (their
    exponentials interleaved) and other rows one at a time: a row's P and lse are the same bits
    either way: rows 0-7 (one of large scores, taking its own max first) make two groups in
    order, and are alone once a window's row (keys of its own) sits between every two."""
    from qkv import jit
    comp = jit.load(jit.ROWS)
    if comp is None:
        pytest.skip("the fast extra (numba) is not installed, or QKV_JIT=0")
    rng = np.random.default_rng(9)
    n, tk = 16, 40
    s = (rng.standard_normal((1, n, tk)) * 3).astype(np.float32)
    s[0, 2] *= 1e3                                        # scores beyond 2^100: the row's max first
    lo, hi = np.zeros(n, np.int64), np.full(n, tk, np.int64)
    lo[8:], hi[8:] = np.arange(8), np.arange(8) + 30      # rows 8-15: keys of their own (a window)
    klo, khi = (rng.integers(0, 2 ** 32, (1, n), dtype=np.uint32) for _ in range(2))
    perm = np.stack([np.arange(8), np.arange(8, 16)], axis=1).reshape(-1)   # 0, 8, 1, 9, ...: no group of four
    runs = []
    for order in (np.arange(n), perm):
        x, lse = s[:, order].copy(), np.zeros((1, n), np.float32)
        comp.forward_pass(x, lo[order], hi[order], np.float32(0.125 * 1.4426950408889634), np.float32(0.125),
                          np.float32(0.0), np.float32(0.0), lse, klo[:, order], khi[:, order], 0,
                          np.uint32(2 ** 31), np.float32(1 / 0.9), False, drop)
        back = np.argsort(order)
        runs.append((x[:, back], lse[:, back]))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_strided_heads_read_in_place_give_the_copies_bits(monkeypatch):
    """q, k, v as a layer makes them, (B, H, T, D) views of one (B, T, 3, H, D) projection,
    and dout as (B, T, H, D) transposed: handed to BLAS in place (each head's row stride its
    leading dimension, no copy); the same bits as contiguous copies, on one thread and two,
    and within the budget."""
    rng = np.random.default_rng(3)
    b, t, h, d = 5, 40, 4, 16
    x = rng.standard_normal((b, t, 3, h, d)).astype(np.float32)
    q, k, v = (x[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    dout = rng.standard_normal((b, t, h, d)).astype(np.float32).transpose(0, 2, 1, 3)
    for y in (q, k, v):
        y4, inner = rows._heads4(y)
        assert inner == h and np.shares_memory(y4, x)          # no copy
    bad = x[:, :, 0, :, ::2].transpose(0, 2, 1, 3)            # a column stride BLAS cannot take: copied
    assert not np.shares_memory(rows._heads4(bad)[0], x)
    monkeypatch.setattr(rows, "SERIAL_WORK", 0)
    copies = [np.ascontiguousarray(a) for a in (q, k, v, dout)]
    for threads in (1, 2):
        with kernel_threads(threads):
            got, want = [], []
            for (qq, kk, vv, dd), res in (((q, k, v, dout), got), (copies, want)):
                out, lse = qkv.attention(qq, kk, vv, causal=True, return_lse=True)
                res += [out, lse, *qkv.attention_backward(dd, qq, kk, vv, out, lse, causal=True)]
        for a, c in zip(got, want):
            np.testing.assert_array_equal(a, c)
    assert _check(q, k, v, dout, causal=True) == []
    assert _check(bad, bad, bad, dout[..., ::2], causal=True) == []


@pytest.mark.parametrize("seed", range(40))
def test_key_runs_are_the_masks_rows(seed):
    rng = np.random.default_rng(seed)
    tq, tk = (int(x) for x in rng.integers(1, 40, 2))
    opts = {}
    if rng.random() < 0.6:
        opts["causal"] = ["top_left", "bottom_right", True][int(rng.integers(3))]
    if rng.random() < 0.5:
        left, right = (None if rng.random() < 0.3 else int(rng.integers(0, 12)) for _ in range(2))
        opts["window"] = (left, 0 if "causal" in opts and right is not None else right)  # causal: no right side
    if rng.random() < 0.4:
        opts["chunk"] = int(rng.integers(1, 12))
    q, k, v, _ = inputs((2, tq, 4), (2, tk, 4))
    spec = api.prepare(q, k, v, **opts).spec
    ok = spec.allowed()
    ok = np.ones((tq, tk), bool) if ok is None else np.broadcast_to(ok, (tq, tk))
    lo, hi = rows.key_runs(spec)
    j = np.arange(tk)
    np.testing.assert_array_equal((j >= lo[:, None]) & (j < hi[:, None]), ok, err_msg=str(opts))


def test_chosen_only_where_it_applies():
    q, k, v, _ = inputs((4, 4, 64, 16), (4, 4, 64, 16))
    assert api.choose_kernel("auto", api.prepare(q, k, v, causal=True), False) is api.ROWS
    assert api.choose_kernel("auto", api.prepare(q, k, v), True) is not api.ROWS          # weights
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    assert api.choose_kernel("auto", api.prepare(q64, k64, v64), False) is not api.ROWS   # float64
    for opts in (dict(kv_lengths=np.arange(4) * 10 + 5), dict(bias=np.zeros((64, 64), np.float32)),
                 dict(mask=np.tri(64, dtype=bool)), dict(alibi=np.ones(4, np.float32))):
        assert api.choose_kernel("auto", api.prepare(q, k, v, **opts), False) is not api.ROWS, opts
    qa, ka, va, _ = inputs((1, 2, 1100, 16), (1, 2, 1100, 16))                     # past 1024²: the tiles
    assert api.choose_kernel("auto", api.prepare(qa, ka, va), False) is not api.ROWS
    assert api.choose_kernel("reference", api.prepare(q, k, v), False) is not api.ROWS    # a method named: that one


@pytest.mark.parametrize("opts", [dict(softcap=50.0, causal=True), dict(softcap=5.0), dict(dropout_p=0.1, dropout_seed=3),
                                  dict(dropout_p=0.5, dropout_seed=2**63 + 5, softcap=20.0, causal="bottom_right"),
                                  dict(dropout_p=0.2, dropout_seed=7, window=(9, 0), causal=True)])
@pytest.mark.slow
@pytest.mark.parametrize("std", [1.0, 6.0])   # scores of std 1 and about 36 (Gemma 2's range against its cap of 50)
def test_softcap_and_dropout_against_the_oracle(opts, std):
    """The keep-mask is the oracle's, written from qkv.score_ops' definition, and the softcap's
    tanh passes into the backward: every result within the float32 budget, lse undropped."""
    q, k, v, dout = inputs((2, 4, 300, 16), (2, 2, 300, 16), scale=std)   # 300 rows: causal blocks too
    dlse = np.random.default_rng(4).standard_normal(q.shape[:-1]).astype(np.float32)
    assert _check(q, k, v, dout, gqa=True, **opts) == []
    assert _check(q, k, v, dout, dlse=dlse, gqa=True, **opts) == []


def test_dropout_draws_the_tiled_kernels_mask():
    """The same seed gives the row kernel and the tiled kernel one mask: their outputs agree to
    float32 rounding, and another seed moves them by far more."""
    q, k, v, _ = inputs((1, 2, 200, 16), (1, 2, 200, 16))
    rows_out = qkv.attention(q, k, v, causal=True, dropout_p=0.3, dropout_seed=11)
    tiled = qkv.attention(q, k, v, causal=True, dropout_p=0.3, dropout_seed=11, method="flash")
    other = qkv.attention(q, k, v, causal=True, dropout_p=0.3, dropout_seed=12, method="flash")
    assert np.abs(rows_out - tiled).max() < 1e-5 < np.abs(rows_out - other).max()


def test_hugging_faces_gqa_layout_read_in_place_gives_the_copies_bits():
    hf_gqa_layout_case(api.ROWS, 8)


@pytest.mark.parametrize("concurrent", [True, False])
def test_calls_from_several_python_threads_at_once(concurrent, monkeypatch):
    """Python threads calling at the same time (an encoder's batches, a server's requests) get
    what one call alone gives; where numba's threading layer takes no concurrent callers
    (``workqueue``) the calls run one at a time."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(rows._fused(), "CONCURRENT", concurrent)
    monkeypatch.setattr(rows, "SERIAL_WORK", 0)
    problems = [inputs((3, 4, 70, 16), (3, 2, 70, 16), seed=s) for s in range(6)]

    def run(p):
        q, k, v, dout = p
        out, lse = qkv.attention(q, k, v, gqa=True, causal=True, return_lse=True)
        return (out, lse) + qkv.attention_backward(dout, q, k, v, out, lse, gqa=True, causal=True)

    alone = [run(p) for p in problems]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(run, problems * 3))
    for i, got in enumerate(together):
        for a, b in zip(got, alone[i % len(problems)]):
            np.testing.assert_array_equal(a, b)


def test_blas_found_and_threading_layer_known():
    mod = rows._fused()
    assert mod.SGEMM != 0 and mod.LAYER in ("omp", "tbb", "workqueue")
    assert mod.CONCURRENT == (mod.LAYER != "workqueue")
