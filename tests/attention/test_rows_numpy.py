"""The row kernel without the fast extra (``qkv.kernels.rows.numpy_rows``): what ``method="auto"``
runs for float32 sequences of up to 1024 keys when numba is absent. Judged against the float64
oracle by the differential harness's budget, bit-identical for any thread count, and chosen
only where it applies. With numba present the compiled row kernel is set aside for these
tests, so they run in every CI leg."""
import numpy as np
import pytest

import qkv
from qkv import api
from qkv.kernels.rows import kernel as rows, numpy_rows as rows_numpy
from qkv.threads import kernel_threads

from row_cases import (MASKS, check, differential_cases, hf_gqa_layout, hf_gqa_layout_case, inputs, large_scores,
                       one_hot_row)


@pytest.fixture(autouse=True)
def without_the_fast_extra(monkeypatch):
    """The compiled row kernel set aside, and this one taken at any size (auto leaves the
    smallest problems to the reference: test_chosen_only_where_it_applies)."""
    monkeypatch.setattr(rows, "applies", lambda spec, dtype: False)
    monkeypatch.setattr(api, "AUTO_ROWS_NUMPY_MIN", 0)


def _check(q, k, v, dout, dlse=None, **opts) -> list:
    return check(api.ROWS_NUMPY, q, k, v, dout, dlse=dlse, **opts)


@pytest.mark.parametrize("opts", MASKS)
@pytest.mark.parametrize("shape", [((2, 4, 33, 16), (2, 2, 45, 16)),   # GQA, Tq < Tk
                                   ((3, 2, 50, 8), (3, 2, 20, 8)),     # Tq > Tk: bottom-right rows that see nothing
                                   ((2, 3, 150, 32), (2, 3, 150, 32))])  # causal blocks of 64, some skipping keys
def test_masks_and_groups_within_the_float32_budget(opts, shape):
    q, k, v, dout = inputs(*shape)
    gqa = q.shape[1] != k.shape[1]
    dlse = np.random.default_rng(1).standard_normal(q.shape[:-1]).astype(np.float32)
    assert _check(q, k, v, dout, gqa=gqa, **opts) == []
    assert _check(q, k, v, dout, dlse=dlse, gqa=gqa, **opts) == []


@pytest.mark.parametrize("std", [1.0, 2.0, 5.5])  # scaled scores of std ~1, ~4 and ~30 (a trained model's)
def test_trained_model_magnitudes_and_the_blocks_done_again(std, monkeypatch):
    """Scores whose exp leaves [2^-60, 2^64] without the max (beyond ~±40, or a row of scores
    all under ~-42): those blocks are computed again with their max first, and every result
    stays within the budget, also where lse is rounded at a magnitude of hundreds."""
    again = []
    block = rows_numpy._block
    monkeypatch.setattr(rows_numpy, "_block", lambda *a: again.append(len(a) > 7) or block(*a))  # shift: done again
    q, k, v, dout = inputs((2, 3, 70, 16), (2, 3, 70, 16), scale=std)
    for opts in (dict(causal=True), dict(scale=-0.3), dict(), dict(scale=3.0)):
        again.clear()
        assert _check(q, k, v, dout, **opts) == []
        if std > 2 or not opts:         # big scores are done again; unit scores at the default scale never
            assert any(again) == (std > 2), (opts, again)


@pytest.mark.parametrize("magnitude", [2e9, 4e9, 1e20, 1e30])
def test_large_finite_scores_and_an_lse_an_ulp_off(magnitude):
    """Issue 34: the backward's ``exp(S - lse)`` overflowed (NaN) where lse lay an ulp below the
    block's own max score and vanished (gradients 0) an ulp above: at 4e9 an ulp is 256. Every
    lse within two ulps of the forward's gives the same one-hot gradients."""
    q, k, v, dout = one_hot_row(magnitude)
    out, lse = qkv.attention(q, k, v, return_lse=True)
    np.testing.assert_array_equal(out[0, 0, 0], v[0, 0, 6])
    assert _check(q, k, v, dout) == []
    want = qkv.attention_backward(dout, q, k, v, out, lse, method="flash")
    for steps in (-2, -1, 1, 2):
        off = lse.copy()
        for _ in range(abs(steps)):
            off = np.nextafter(off, np.float32(np.inf * steps))
        got = qkv.attention_backward(dout, q, k, v, out, off)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("std", [3e4, 1e6, 1e8, 1e15, 1e30])
def test_large_random_scores_within_the_float32_budget(std):
    q, k, v, dout = large_scores(std)
    dlse = np.random.default_rng(2).standard_normal(q.shape[:-1]).astype(np.float32)
    for opts in (dict(), dict(causal=True), dict(window=(5, 3))):
        assert _check(q, k, v, dout, dlse=dlse, **opts) == []


def test_rows_that_see_nothing_and_a_nan():
    q, k, v, dout = inputs((1, 2, 16, 8), (1, 2, 10, 8))
    out, lse = qkv.attention(q, k, v, causal="bottom_right", return_lse=True)
    assert (out[:, :, :6] == 0).all() and (lse[:, :, :6] == -np.inf).all()
    dq, dk, dv = qkv.attention_backward(dout, q, k, v, out, lse, causal="bottom_right")
    assert (dq[:, :, :6] == 0).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    q[0, 1, 5, 3] = np.nan
    out = qkv.attention(q, k, v)
    bad = np.zeros(out.shape[:-1], bool)
    bad[0, 1, 5] = True
    assert np.isnan(out[bad]).all() and np.isfinite(out[~bad]).all()


def test_the_differential_cases_it_takes():
    """The harness's random float32 problems (lengths, extreme values, every alignment) that
    this kernel takes: all within the budget, and enough of them to mean something."""
    taken, fails = differential_cases(api.ROWS_NUMPY)
    assert fails == []
    assert taken >= 20


def test_the_same_bits_for_any_thread_count_and_strided_heads(monkeypatch):
    """Threads 1, 2, 3 and heads read in place (a layer's (B, H, T, D) views of one
    (B, T, 3, H, D) projection, dout as (B, T, H, D) transposed) or as contiguous copies:
    the same bits."""
    monkeypatch.setattr(rows_numpy, "FORWARD_SERIAL_WORK", 0)   # the forward on threads too
    rng = np.random.default_rng(3)
    b, t, h, d = 6, 97, 4, 24
    x = rng.standard_normal((b, t, 3, h, d)).astype(np.float32)
    q, k, v = (x[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    dout = rng.standard_normal((b, t, h, d)).astype(np.float32).transpose(0, 2, 1, 3)
    runs = []
    for threads in (1, 2, 3):
        for arrays in ((q, k, v, dout), tuple(np.ascontiguousarray(a) for a in (q, k, v, dout))):
            qq, kk, vv, dd = arrays
            with kernel_threads(threads):
                out, lse = qkv.attention(qq, kk, vv, causal=True, return_lse=True)
                runs.append((out, lse) + qkv.attention_backward(dd, qq, kk, vv, out, lse, causal=True))
    for other in runs[1:]:
        for a, c in zip(runs[0], other):
            np.testing.assert_array_equal(a, c)
    assert _check(q, k, v, dout, causal=True) == []


@pytest.mark.parametrize("per", [3, 5])  # heads a unit: units that straddle items of 4
def test_units_that_straddle_items_give_the_same_bits(per, monkeypatch):
    """Heads read in place as (B/inner, inner, T, D) stacks (a layer's views of one
    (B, T, 3, H, D) projection): a unit that straddles items is cut in pieces, each a view, and
    the bits are those of one unit a thread."""
    rng = np.random.default_rng(3)
    b, t, h, d = 5, 40, 4, 16
    x = rng.standard_normal((b, t, 3, h, d)).astype(np.float32)
    q, k, v = (x[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    dout = rng.standard_normal((b, t, h, d)).astype(np.float32).transpose(0, 2, 1, 3)
    assert rows._Heads(q, h).x.ndim == 4 and np.shares_memory(rows._Heads(q, h).x, x)  # no copy
    monkeypatch.setattr(rows, "SERIAL_WORK", 0)
    monkeypatch.setattr(rows_numpy, "FORWARD_SERIAL_WORK", 0)
    runs = []
    for unit in (None, per):
        if unit:
            blocks = rows.row_blocks(api.prepare(q, k, v, causal=True).spec, rows_numpy.BACKWARD_ROWS)
            monkeypatch.setattr(rows_numpy, "UNIT_ENTRIES", unit * max((r1 - r0) * (k1 - k0)
                                                                        for r0, r1, k0, k1, _, _ in blocks))
            seen = []
            monkeypatch.setattr(rows, "_pieces", lambda a, b, inner, f=rows._pieces: seen.append((a, b)) or f(a, b, inner))
        with kernel_threads(2):
            out, lse = qkv.attention(q, k, v, causal=True, return_lse=True)
            runs.append((out, lse) + qkv.attention_backward(dout, q, k, v, out, lse, causal=True))
    assert (0, per) in seen and any(len(rows._pieces(a, b, h)) > 1 for a, b in seen)
    for a, c in zip(*runs):
        np.testing.assert_array_equal(a, c)


def test_pieces_never_straddle_an_item_partly():
    for inner in (1, 3, 4):
        for a in range(13):
            for b in range(a + 1, 14):
                pieces = rows._pieces(a, b, inner)
                assert [p for piece in pieces for p in range(*piece)] == list(range(a, b))
                for x, y in pieces:
                    assert x // inner == (y - 1) // inner or (x % inner == 0 and y % inner == 0)


def test_hugging_faces_gqa_layout_read_in_place_gives_the_copies_bits():
    hf_gqa_layout_case(api.ROWS_NUMPY, 5)
    q, k, v, _ = hf_gqa_layout(5)
    kb, vb = (np.broadcast_to(x[:1], x.shape) for x in (k, v))  # kv heads shared by the batch: stride 0
    got = qkv.attention(q, kb, vb, causal=True, gqa=True)
    np.testing.assert_array_equal(got, qkv.attention(q, *(np.ascontiguousarray(x) for x in (kb, vb)),
                                                     causal=True, gqa=True))


def _numpy_says_view(x, shape):
    y = x.view()
    try:
        y.shape = shape          # NumPy's own rule: raises where the reshape would need a copy
    except AttributeError:
        return False
    return True


def test_view_decides_from_the_strides_as_numpy_does():
    rng = np.random.default_rng(6)
    base = rng.standard_normal((3, 5, 4, 2, 6)).astype(np.float32)
    arrays = [base, base.transpose(0, 2, 1, 3, 4), base[:, :, 1], base[:, :, 1].transpose(0, 2, 1, 3),
              base[::2], base[:, ::2], base[:1], base[:, :, :1], np.broadcast_to(base[:1], base.shape),
              np.broadcast_to(base[:, :1], base.shape), base[0, 0], base.transpose(1, 0, 2, 3, 4)[:, :1],
              base[0], base[::-1], base[::-1, ::-1], base[:, ::-1].transpose(1, 0, 2, 3, 4)]
    for x in arrays:
        t, d = x.shape[-2:]
        for shape in ((-1, t, d), (-1, x.shape[-3], t, d) if x.ndim > 2 else (-1, 1, t, d)):
            if len(shape) == 4 and x.ndim == 2:
                continue
            got = rows._view(x, shape)
            assert (got is not None) == _numpy_says_view(x, shape), (x.shape, x.strides, shape)
            if got is not None:
                assert np.shares_memory(got, x)
                np.testing.assert_array_equal(got, x.reshape(shape))


def test_chosen_only_where_it_applies(monkeypatch):
    monkeypatch.setattr(api, "AUTO_ROWS_NUMPY_MIN", 2 ** 14)
    q, k, v, _ = inputs((1, 4, 64, 16), (1, 4, 64, 16))                                 # 2^14 entries
    assert api.choose_kernel("auto", api.prepare(q, k, v, causal=True), False) is api.ROWS_NUMPY
    small = api.prepare(q[:, :3], k[:, :3], v[:, :3], causal=True)                        # 3 · 2^12: the reference
    assert api.choose_kernel("auto", small, False) is not api.ROWS_NUMPY
    q, k, v, _ = inputs((4, 4, 64, 16), (4, 4, 64, 16))
    assert api.choose_kernel("auto", api.prepare(q, k, v, causal=True), False) is api.ROWS_NUMPY
    assert api.choose_kernel("auto", api.prepare(q, k, v), True) is not api.ROWS_NUMPY           # weights
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    assert api.choose_kernel("auto", api.prepare(q64, k64, v64), False) is not api.ROWS_NUMPY    # float64: the reference's bits
    for opts in (dict(kv_lengths=np.arange(4) * 10 + 5), dict(bias=np.zeros((64, 64), np.float32)),
                 dict(mask=np.tri(64, dtype=bool)), dict(alibi=np.ones(4, np.float32)), dict(softcap=30.0),
                 dict(dropout_p=0.1, dropout_seed=1)):
        assert api.choose_kernel("auto", api.prepare(q, k, v, **opts), False) is not api.ROWS_NUMPY, opts
    qa, ka, va, _ = inputs((1, 2, 1100, 16), (1, 2, 1100, 16))                            # past 1024²: the tiles
    assert api.choose_kernel("auto", api.prepare(qa, ka, va), False) is not api.ROWS_NUMPY


@pytest.mark.parametrize("causal, t, threaded", [(True, 64, False), (False, 64, True), (True, 256, True)])
def test_a_forward_of_small_passes_stays_on_the_calling_thread(monkeypatch, causal, t, threaded):
    """A forward whose blocks average under FORWARD_SERIAL_WORK entries (all heads) runs with
    one thread; the backward of the same problem, and a forward of bigger blocks, keep the
    caller's threads."""
    seen = []
    monkeypatch.setattr(rows_numpy, "_run", lambda job, n, tq, tk, group, nt, *a, f=rows_numpy._run:
                        seen.append(nt) or f(job, n, tq, tk, group, nt, *a))
    monkeypatch.setattr(rows, "applies", lambda *a: False)          # the NumPy-only kernel
    monkeypatch.setattr(api, "AUTO_ROWS_NUMPY_MIN", 0)
    rng = np.random.default_rng(0)
    q, k, v, d = (rng.standard_normal((12, 4, t, 32)).astype(np.float32) for _ in range(4))
    with kernel_threads(2):
        out, lse = qkv.attention(q, k, v, causal=causal, return_lse=True)
        qkv.attention_backward(d, q, k, v, out, lse, causal=causal)
    blocks = rows.row_blocks(api.prepare(q, k, v, causal=causal).spec)
    average = 48 * sum((r1 - r0) * (k1 - k0) for r0, r1, k0, k1, _, _ in blocks) / len(blocks)
    assert (average >= rows_numpy.FORWARD_SERIAL_WORK) == threaded
    assert seen == [None if threaded else 1, None], seen
