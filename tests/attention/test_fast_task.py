"""A tiled forward task with its Python cut to compiled calls (qkv.kernels.flash.fast_task): every
row's out and lse with the bits the task had through _attempt, whichever way it leaves the fast path."""
import numpy as np
import pytest
from flash_helpers import float32_inputs

import qkv
from qkv import jit
from qkv import threads as qkv_threads
from qkv.kernels.flash import fast_task


def _unit(rng, shape, norm):
    x = rng.standard_normal(shape)
    return (x / np.linalg.norm(x, axis=-1, keepdims=True) * norm).astype(np.float32)


def _transposed(q):   # (B, H, T, D) rows of a (B, T, H, D) array, as a layer's heads are
    return np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


CASES = [  # (name, q shape, kv shape, Dv, options)
    ("full", (1, 4, 1500, 64), (1, 4, 1500, 64), 64, {}),
    ("causal", (1, 4, 1500, 64), (1, 4, 1500, 64), 64, dict(causal=True)),
    ("window", (1, 3, 1100, 32), (1, 3, 1100, 32), 32, dict(window=(50, 20))),
    ("gqa causal", (2, 8, 1100, 64), (2, 2, 1100, 64), 64, dict(gqa=True, causal=True)),
    ("lengths", (3, 2, 1200, 64), (3, 2, 1200, 64), 64,
     dict(causal=True, kv_lengths=np.array([1200, 333, 17]), q_lengths=np.array([1200, 700, 40]))),
    ("bottom right", (1, 2, 600, 64), (1, 2, 1800, 64), 64, dict(causal=True, align="bottom_right")),
    ("Dv 48, D 128", (1, 2, 1100, 128), (1, 2, 1100, 128), 48, dict(causal=True)),
    ("softcap", (1, 2, 1100, 64), (1, 2, 1100, 64), 64, dict(causal=True, softcap=20.0)),
    ("dropout", (1, 2, 1100, 64), (1, 2, 1100, 64), 64, dict(dropout_p=0.1, dropout_seed=3)),
]


def _module():
    mod = jit.load(jit.FLASH_TASK)
    if mod is None or not mod.ADDR[0]:
        pytest.skip("the fast task needs numba (the fast extra) and a BLAS sgemm it can call")
    return mod


def _ways(monkeypatch) -> dict:
    """Counts of the tasks :func:`fast_task.run` made and turned away, of those run again, and of
    the offsets it asked for (above 0 somewhere)."""
    seen = {"made": 0, "turned away": 0, "again": 0, "offsets": 0}
    run, close, offsets = fast_task.run, fast_task.close, fast_task.rows_bound.offsets

    def counted_offsets(*a):
        m, may = offsets(*a)
        seen["offsets"] += bool(m.any())
        return m, may

    def counted_run(*a, **kw):
        made = run(*a, **kw)
        seen["made" if made else "turned away"] += 1
        return made

    def counted_close(*a):
        again, large = close(*a)
        seen["again"] += len(again)
        return again, large
    monkeypatch.setattr(fast_task, "run", counted_run)
    monkeypatch.setattr(fast_task, "close", counted_close)
    monkeypatch.setattr(fast_task.rows_bound, "offsets", counted_offsets)
    return seen


def _both(monkeypatch, q, k, v, opts, ways):
    """``(out, lse)`` with the fast task, then without it (each task through _attempt); ``ways``
    as the first call left it."""
    got = qkv.attention(q, k, v, method="flash", return_lse=True, **opts)
    first = dict(ways)
    with monkeypatch.context() as m:
        m.setattr(fast_task, "open_rows", lambda *a: None)
        want = qkv.attention(q, k, v, method="flash", return_lse=True, **opts)
    ways.clear()
    ways.update(first)
    return got, want


def _same(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("layout", ["dense", "transposed"])
@pytest.mark.parametrize("magnitude", [1.0, 2.5])   # 2.5: scores of about ±30 and beyond
@pytest.mark.parametrize("name,sq,sk,dv,opts", CASES, ids=[c[0] for c in CASES])
def test_the_fast_task_keeps_every_rows_bits(monkeypatch, name, sq, sk, dv, opts, magnitude, layout):
    _module()
    q, k, v = float32_inputs(len(name), sq, sk, dv, magnitude)
    q = _transposed(q) if layout == "transposed" else q
    ways = _ways(monkeypatch)
    got, want = _both(monkeypatch, q, k, v, opts, ways)
    assert ways["made"], ways
    offsets = magnitude > 1 and "softcap" not in opts      # at ±30 offsets above 0; capped scores never need them
    assert ways["offsets"] if offsets else not ways["offsets"], ways
    _same(got, want)
    ref = qkv.attention(*(x.astype(np.float64) for x in (q, k, v)), method="reference", **opts)
    np.testing.assert_allclose(got[0], ref, atol=2e-5 * magnitude ** 2 * (1 + 50 * ("dropout_p" in opts)))


def _large_rows(rng):       # q = k of norm 16.7: a row's own score 35, its lse past 16 + log Tk
    x = _unit(rng, (1, 2, 1024, 64), 16.7)
    return x, x.copy(), rng.standard_normal((1, 2, 1024, 64)).astype(np.float32), dict(causal=True)


def _offset_needed(rng):    # a bound past the headroom: the offsets are not 0
    q, k, v = float32_inputs(1, (1, 2, 1024, 64), (1, 2, 1024, 64), 64, 4.0)
    return q, k, v, {}


def _not_finite(rng):       # a NaN and an inf in q
    q, k, v = float32_inputs(2, (1, 2, 1024, 64), (1, 2, 1024, 64), 64)
    q[0, 0, 700, 3], q[0, 1, 5, 0] = np.nan, np.inf
    return q, k, v, dict(causal=True)


def _tiny_terms(rng):       # q against every key: its terms below 2^-58 of the bound, l too small
    u = _unit(rng, (1, 1, 1, 64), 1.0)
    k = np.broadcast_to(u * 20, (1, 2, 1024, 64)).copy()
    q = np.broadcast_to(-u * 20, (1, 2, 1024, 64)).copy()
    q[0, 1] = _unit(rng, (1024, 64), 1.0)            # the other head passes
    return q, k, rng.standard_normal((1, 2, 1024, 64)).astype(np.float32), {}


WAYS_OUT = [  # (make inputs, the way out: "turned away" before or after the tiles, or run "again")
    (_large_rows, "again"),
    (_offset_needed, "turned away"),
    (_not_finite, "turned away"),
    (_tiny_terms, "turned away"),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # inf - inf of an inf input, from a worker thread too
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("make,way", WAYS_OUT, ids=[w[0].__name__.strip("_") for w in WAYS_OUT])
def test_each_way_off_the_fast_task_gives_the_bits_it_had(monkeypatch, make, way, threads):
    _module()
    q, k, v, opts = make(np.random.default_rng(5))
    monkeypatch.setitem(qkv_threads._state, "threads", threads)
    ways = _ways(monkeypatch)
    got, want = _both(monkeypatch, q, k, v, opts, ways)
    assert ways[way], ways
    _same(got, want)


def test_the_fast_task_is_the_same_on_every_thread_count(monkeypatch):
    _module()
    q, k, v = float32_inputs(9, (2, 4, 1300, 64), (2, 4, 1300, 64), 64)
    runs = []
    for threads in (1, 2, 3):
        monkeypatch.setitem(qkv_threads._state, "threads", threads)
        runs.append(qkv.attention(q, k, v, method="flash", causal=True, return_lse=True))
    for other in runs[1:]:
        _same(other, runs[0])


def test_a_task_turned_away_after_its_tiles_leaves_nothing_behind(monkeypatch):
    """A task whose row fails after the tiles: ``run`` gives False, its ``l`` is cleared."""
    _module()
    q, k, v, opts = _tiny_terms(np.random.default_rng(6))
    made = []
    run = fast_task.run
    monkeypatch.setattr(fast_task, "run", lambda fast, *a: made.append((fast, run(fast, *a))) or made[-1][1])
    qkv.attention(q, k, v, method="flash", return_lse=True, **opts)
    fast = made[0][0]
    assert {m for _, m in made} == {True, False}
    assert not fast.l[~fast.taken].any() and fast.l[fast.taken].all()


@pytest.mark.parametrize("opts,dtype", [(dict(alibi=np.array([0.1, 0.3])), np.float32), ({}, np.float64)],
                         ids=["alibi", "float64"])
def test_calls_the_fast_task_does_not_compute_never_reach_it(monkeypatch, opts, dtype):
    _module()
    q, k, v = (x.astype(dtype) for x in float32_inputs(4, (1, 2, 1100, 64), (1, 2, 1100, 64), 64))
    ways = _ways(monkeypatch)
    qkv.attention(q, k, v, method="flash", causal=True, **opts)
    assert ways == {"made": 0, "turned away": 0, "again": 0, "offsets": 0}
