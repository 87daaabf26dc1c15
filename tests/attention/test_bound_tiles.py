"""The tiled forward's fast path, a task's tiles in one compiled call (qkv.kernels.flash.task_compiled):
the bits of the Python loop over the same tiles, taken only where it computes what that loop does."""
import numpy as np
import pytest
from flash_helpers import float32_inputs

import qkv
from qkv import jit
from qkv import threads as qkv_threads
from qkv.kernels.flash import bound_tiles

TAKEN = [  # (name, q shape, kv shape, Dv, options): every task's tiles may go to the compiled call
    ("full", (2, 4, 700, 64), (2, 4, 700, 64), 64, {}),
    ("causal", (1, 4, 1500, 64), (1, 4, 1500, 64), 64, dict(causal=True)),
    ("window", (1, 3, 900, 32), (1, 3, 900, 32), 32, dict(window=(50, 20))),
    ("bottom right", (1, 4, 300, 64), (1, 4, 800, 64), 64, dict(causal=True, align="bottom_right")),
    ("kv_lengths", (3, 2, 600, 64), (3, 2, 600, 64), 64, dict(causal=True, kv_lengths=np.array([600, 333, 17]))),
    ("q_lengths", (3, 2, 600, 64), (3, 2, 600, 64), 64, dict(causal=True, q_lengths=np.array([600, 333, 40]))),
    ("gqa stacked", (2, 8, 20, 64), (2, 2, 900, 64), 64, dict(gqa=True)),
    ("gqa causal", (2, 8, 400, 64), (2, 2, 400, 64), 64, dict(gqa=True, causal=True)),
    ("Dv 48, D 128", (1, 2, 1100, 128), (1, 2, 1100, 128), 48, dict(causal=True)),
    ("cross", (1, 4, 333, 64), (1, 4, 1234, 64), 64, {}),
]
NOT_TAKEN = [  # a tile the compiled call does not compute as the loop does: the loop runs them all
    ("softcap", dict(causal=True, softcap=20.0)),
    ("dropout", dict(causal=True, dropout_p=0.1, dropout_seed=3)),
    ("alibi", dict(causal=True, alibi=np.array([0.1, 0.3]))),
    ("chunk", dict(causal=True, chunk=128)),
    ("mask", dict(mask=np.tri(600, 600, 5, dtype=bool)[::-1])),
]


def _module():
    mod = jit.load(jit.FLASH_TASK)
    if mod is None or not mod.ADDR[0]:
        pytest.skip("the compiled task needs numba (the fast extra) and a BLAS sgemm it can call")
    return mod


def _calls(monkeypatch, mod) -> list:
    calls, real = [], mod.bound_task
    monkeypatch.setattr(mod, "bound_task", lambda *a: calls.append(a[7].shape[0]) or real(*a))
    return calls


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("magnitude", [1.0, 2.5])   # 2.5: scores of about ±30 and beyond
@pytest.mark.parametrize("name,sq,sk,dv,opts", TAKEN, ids=[c[0] for c in TAKEN])
def test_a_task_in_one_compiled_call_has_the_loops_bits(monkeypatch, name, sq, sk, dv, opts, magnitude, threads):
    mod = _module()
    q, k, v = float32_inputs(len(name), sq, sk, dv, magnitude)
    calls = _calls(monkeypatch, mod)
    monkeypatch.setitem(qkv_threads._state, "threads", threads)
    out, lse = qkv.attention(q, k, v, method="flash", return_lse=True, **opts)
    assert calls, "the compiled call never ran"
    monkeypatch.setattr(bound_tiles, "_plan", lambda *a: None)    # the Python loop, tile by tile
    want, want_lse = qkv.attention(q, k, v, method="flash", return_lse=True, **opts)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    ref = qkv.attention(*(x.astype(np.float64) for x in (q, k, v)), method="reference", **opts)
    np.testing.assert_allclose(out, ref, atol=2e-5 * magnitude ** 2)


@pytest.mark.parametrize("name,opts", NOT_TAKEN, ids=[c[0] for c in NOT_TAKEN])
def test_tiles_it_cannot_take_go_through_the_loop(monkeypatch, name, opts):
    mod = _module()
    q, k, v = float32_inputs(3, (1, 2, 600, 64), (1, 2, 600, 64), 64)
    calls = _calls(monkeypatch, mod)
    out = qkv.attention(q, k, v, method="flash", **opts)
    assert not calls
    if "dropout_p" not in opts:
        ref = qkv.attention(*(x.astype(np.float64) for x in (q, k, v)), method="reference", **opts)
        np.testing.assert_allclose(out, ref, atol=2e-5)


def test_a_product_numpy_makes_as_matrix_vector_goes_through_the_loop(monkeypatch):
    """D = 1 (and a tile one key or one row wide): NumPy's matmul takes BLAS's matrix-vector
    product there, which rounds otherwise; the compiled call's sgemm would not give its bits."""
    mod = _module()
    calls = _calls(monkeypatch, mod)
    q, k, v = float32_inputs(4, (1, 2, 600, 1), (1, 2, 600, 1), 1)
    qkv.attention(q, k, v, method="flash", causal=True)
    q, k, v = float32_inputs(5, (1, 2, 600, 64), (1, 2, 600, 64), 64)
    qkv.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), method="flash", causal=True)
    assert not calls


def test_the_rows_finish_in_one_pass_as_numpy_divides_and_checks_them():
    """``acc / l`` in float64 rounded once, and ok where l is large enough and the row finite:
    the compiled pass against NumPy's, bit for bit, with rows that see nothing, NaN and inf."""
    _module()
    rng = np.random.default_rng(9)
    acc = (rng.standard_normal((70, 48)) * 1e3).astype(np.float32)
    l = rng.random(70) * 10.0 ** rng.integers(-30, 30, 70)
    l[:4] = [0.0, np.nan, np.inf, 2.0 ** -58]
    acc[10, 3], acc[11, 0], acc[12, 47] = np.inf, np.nan, -np.inf
    acc[13] = np.finfo(np.float32).max
    f32 = np.dtype(np.float32)
    with np.errstate(all="ignore"):
        out, ok = bound_tiles.finish(acc, l, 2.0 ** -58, f32)
        want = (acc / l[:, None]).astype(np.float32)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(ok, (l >= 2.0 ** -58) & np.isfinite(acc).all(axis=1) & np.isfinite(l))
    assert ok[3] and not ok[:3].any() and not ok[10:13].any() and ok[13]
    mod, clean = _module(), np.empty_like(out)    # the compiled pass says whether every result is finite
    with np.errstate(all="ignore"):
        assert not mod.finish(acc, l, 2.0 ** -58, clean, np.empty(70, bool))
        assert mod.finish(acc[20:], l[20:] + 1.0, 2.0 ** -58, clean[20:], np.empty(50, bool))
        assert not mod.finish(acc[13:14], np.array([0.5]), 2.0 ** -58, clean[:1], np.empty(1, bool))   # max / 0.5
