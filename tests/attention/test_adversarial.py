"""Adversarial search, kept in the suite: random option combinations, sizes around tile
boundaries, dtypes, scores up to 1e4 and biases down to ``finfo.min``, with the dense and
the tiled kernel checked against a brute-force oracle written here (forward and backward).

The oracle is tests/oracle.py (every mask rule spelled out from the README's definitions),
run in ``np.longdouble`` (80-bit on x86, so it also judges float64). It sees exactly the
inputs the kernels see (rounded to the case's dtype), so what is measured is each kernel's
own arithmetic.

The budget (DESIGN.md, "Numerics policy"): for every result X in out, lse, dq, dk, dv,
``err(flash) <= B · max(err(dense), floor)`` with ``B = 2`` for scores up to 1e3 and 4 up
to 1e4, errors as norms over the whole array against the oracle. ``floor`` is 4 ulps of
the size of what X sums (``4·eps·‖Σ|terms|‖``, eps of the output dtype): below it an error
is rounding of the result itself, and a ratio of two such errors measures luck; or, where
larger, what rounding the scores alone moves X by (``eps·‖moved‖``, tests/oracle.py): where
one score decides a row, how near it falls to a float is luck too (seed 1618 of the long
run, float64 at scores of 5e3: the dense path errs 4e-15 with OpenBLAS's Haswell kernels
and 3e-13 with its SkylakeX ones, the tiled one 3e-13 on both).

Fast by default (a few seconds); ``QKV_ADVERSARIAL=long`` runs 2,000 cases.
"""
import os
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest

import oracle as definitions
from qkv import api
from qkv.kernels import flash, reference

LONG = os.environ.get("QKV_ADVERSARIAL", "") == "long"
N_CASES = 2000 if LONG else 120
ORACLE = np.longdouble
RESULTS = ("out", "lse", "dq", "dk", "dv")
EXTENDED = np.finfo(ORACLE).eps < np.finfo(np.float64).eps  # can it judge float64?


# ----------------------------------------------------------------------------- the oracle
def _norm(x) -> float:
    """Euclidean norm in ORACLE precision (its range holds the square of finfo(float64).max)."""
    x = np.asarray(x, ORACLE)
    return float(np.sqrt(np.sum(x * x)))


def oracle(q, k, v, dout, opts, eps):
    """``{name: (value, floor)}`` for out, lse, dq, dk, dv: tests/oracle.py (the one test-side
    oracle, every mask rule spelled out from the README) computed in ORACLE precision, for 4-D
    ``(B, H, T, D)`` inputs (k, v may have batch 1, shared; Hkv divides Hq). The floor is
    ``4·eps[name]·‖Σ|terms|‖`` of each result (module docstring)."""
    sol = definitions.solve(q, k, v, dout, dtype=ORACLE, gqa=q.shape[1] != k.shape[1], moved=True, **opts)
    return {name: (getattr(sol, name), eps[name] * max(4 * _norm(sol.size[name]), _norm(sol.moved.get(name, 0))))
            for name in RESULTS}


# ----------------------------------------------------------------------------- the cases
def _tiles(rng):
    """Default tiles, the small ones of test_flash, or random small ones: tile edges everywhere."""
    pick = rng.integers(3)
    if pick == 0:
        return None
    if pick == 1:
        return flash.Tiles(rows=8, scratch=128, bwd_rows=8, bwd_keys=16, stack_rows=4)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    return flash.Tiles(rows=r(1, 12), scratch=r(16, 400), bwd_rows=r(1, 12), bwd_keys=r(1, 40),
                       thin_rows=r(1, 6), gemv_keys=r(1, 40), stack_rows=r(1, 10))


def case(seed):
    """q, k, v, dout (4-D, in the case's dtype), options, the score size and the tiles."""
    rng = np.random.default_rng(seed)
    dtype = [np.float32, np.float32, np.float64, np.float16][seed % 4]
    b = int(rng.integers(1, 3))
    hkv = int(rng.integers(1, 3))
    hq = hkv * int(rng.choice([1, 2, 3]))
    tq = int(rng.choice([1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33]))
    tk = int(rng.choice([1, 2, 3, 15, 16, 17, 31, 32, 33, 47, 48, 49]))
    d = int(rng.choice([1, 2, 8, 13, 16]))
    dv = int(rng.choice([1, 3, d]))
    size = float(10 ** rng.uniform(-1, 4))                 # typical |score|, up to 1e4
    if dtype == np.float16:
        size = min(size, 3e4 / d)                          # q·k must fit float16's inputs
    q = rng.standard_normal((b, hq, tq, d))
    k = rng.standard_normal((1 if rng.random() < 0.2 else b, hkv, tk, d))
    v = rng.standard_normal(k.shape[:3] + (dv,))
    opts = {"scale": float(size / np.sqrt(d))} if rng.random() < 0.7 else {}
    if "scale" not in opts:                                # default scale: put the size in q and k
        q, k = q * np.sqrt(size), k * np.sqrt(size)
    causal = [False, True, "top_left", "bottom_right"][int(rng.integers(4))]
    if causal:
        opts["causal"] = causal
    if rng.random() < 0.3:
        left = None if rng.random() < 0.3 else int(rng.integers(0, 10))
        right = 0 if causal else (None if rng.random() < 0.3 else int(rng.integers(0, 10)))
        opts["window"] = (left, right)
    if rng.random() < 0.3 and k.shape[0] == b:
        opts["kv_lengths"] = rng.integers(0, tk + 1, size=b)
    if rng.random() < 0.25:
        opts["mask"] = rng.random((b if rng.random() < 0.5 else 1, hq if rng.random() < 0.5 else 1, tq, tk)) < 0.8
    if rng.random() < 0.35:
        bias = rng.standard_normal((b if rng.random() < 0.5 else 1, hq, tq, tk)) * size
        low = np.finfo(dtype).min if dtype != np.float16 else np.finfo(np.float32).min
        bias[rng.random(bias.shape) < 0.15] = low         # Hugging Face's mask value
        bias[..., int(rng.integers(tq)), :] = low if rng.random() < 0.5 else bias[..., 0, :]  # a whole row
        bias[rng.random(bias.shape) < 0.05] = -np.inf
        opts["bias"] = bias.astype(np.float32 if dtype == np.float16 else dtype)
    if rng.random() < 0.25:
        opts["alibi"] = rng.uniform(-1, 1, size=hq) * min(size, 50.0)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    if "kv_lengths" in opts:                               # what lies past a length is never read
        for i, n in enumerate(opts["kv_lengths"]):
            k[i, :, n:] = np.nan
            v[i, :, n:] = np.inf
    dout = rng.standard_normal((b, hq, tq, dv)).astype(dtype)
    return q, k, v, dout, opts, size, _tiles(rng)


def run(q, k, v, dout, opts, kern):
    """Public-API semantics (checks, dispatch, sum-back) with the given kernel."""
    prob = api.prepare(q, k, v, gqa=q.shape[1] != k.shape[1], **opts)
    out, lse = api.Prepared(prob, kern).forward(return_lse=True)
    return dict(zip(RESULTS, (out, lse) + api.Prepared(prob, kern).backward(dout, out, lse)))


def _err(x, want) -> float:
    """‖x - want‖ over the entries where want is finite (-inf lse: checked apart)."""
    want = np.asarray(want, ORACLE)
    fin = np.isfinite(want)
    return _norm(np.where(fin, np.asarray(x, ORACLE) - np.where(fin, want, 0), 0))


@pytest.mark.parametrize("seed", range(N_CASES))
def test_kernels_against_the_brute_force_oracle(seed):
    q, k, v, dout, opts, size, tiles = case(seed)
    eps = {name: float(np.finfo(q.dtype).eps) for name in RESULTS}
    eps["lse"] = float(np.finfo(np.float64 if q.dtype == np.float64 else np.float32).eps)  # lse: float32 for float16
    want = oracle(q, k, v, dout, opts, eps)
    dense = run(q, k, v, dout, opts, SimpleNamespace(forward=reference.forward, backward=reference.backward))
    fast = run(q, k, v, dout, opts, SimpleNamespace(forward=partial(flash.forward, tiles=tiles),
                                                     backward=partial(flash.backward, tiles=tiles)))
    budget = 2.0 if size <= 1e3 else 4.0
    for name in RESULTS:
        value, floor = want[name]
        for got in (dense[name], fast[name]):
            assert got.shape == value.shape, name
            # finite exactly where the oracle is (lse -inf for rows that see nothing), never NaN
            np.testing.assert_array_equal(np.isfinite(got), np.isfinite(value), err_msg=name)
        if q.dtype == np.float64 and not EXTENDED:
            continue  # no wider type to judge float64 by on this platform
        e_dense, e_fast = _err(dense[name], value), _err(fast[name], value)
        assert e_fast <= budget * max(e_dense, floor), (
            f"{name}: flash err {e_fast:.3g} > {budget} x max(dense err {e_dense:.3g}, floor {floor:.3g}); "
            f"{q.dtype} q{q.shape} k{k.shape} v{v.shape} size {size:.3g} tiles {tiles} "
            f"options { {key: (val if np.ndim(val) == 0 or key == 'window' else np.shape(val)) for key, val in opts.items()} }")


def test_the_cases_reach_what_they_promise():
    """The draw covers what the module docstring says: every dtype, scores past 1e3, biases
    at finfo.min, rows that see nothing, and tiles small enough to be crossed."""
    seen = {"dtypes": set(), "big": 0, "hf": 0, "empty": 0, "small_tiles": 0}
    for seed in range(N_CASES):
        q, k, v, dout, opts, size, tiles = case(seed)
        seen["dtypes"].add(q.dtype)
        seen["big"] += size > 1e3
        bias = opts.get("bias")
        seen["hf"] += bias is not None and bool((bias == np.finfo(bias.dtype).min).any())
        seen["empty"] += int("kv_lengths" in opts and (opts["kv_lengths"] == 0).any())
        seen["small_tiles"] += tiles is not None and (tiles.rows < q.shape[2] or tiles.bwd_keys < k.shape[2])
    assert seen["dtypes"] == {np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)}
    assert min(seen["big"], seen["hf"], seen["empty"], seen["small_tiles"]) > 0, seen


@pytest.mark.parametrize("causal, gqa, dropout", [(False, False, False), (True, True, False), (False, False, True)])
def test_moved_is_what_rounding_the_scores_moves_the_results_by(causal, gqa, dropout):
    """The oracle's ``moved`` (the floor for rows one score decides) against the spread of the
    results when every score moves by an independent ``h·t_ij·u`` (u of variance 1, through
    the bias): the root-mean-square change over 300 draws is h·moved, to 20 %."""
    rng = np.random.default_rng(7)
    hq, hkv = (4, 2) if gqa else (2, 2)
    q, k = rng.standard_normal((1, hq, 9, 5)) * 2, rng.standard_normal((1, hkv, 13, 5)) * 2
    v, dout = rng.standard_normal((1, hkv, 13, 3)), rng.standard_normal((1, hq, 9, 3))
    bias = rng.standard_normal((1, hq, 9, 13)) * 3
    opts = dict(causal=causal, gqa=gqa, scale=1.5)
    if dropout:
        opts.update(dropout_p=0.3, dropout_seed=5)
    base = definitions.solve(q, k, v, dout, bias=bias, dtype=ORACLE, moved=True, **opts)
    t = 1.5 * (np.abs(q) @ np.abs(np.repeat(k, hq // hkv, axis=1)).swapaxes(-1, -2)) + np.abs(bias)
    h, draws = 1e-9, 300
    sq = {name: 0.0 for name in ("out", "dq", "dk", "dv")}
    for _ in range(draws):
        u = rng.uniform(-np.sqrt(3), np.sqrt(3), bias.shape)
        sol = definitions.solve(q, k, v, dout, bias=bias + h * t * u, dtype=ORACLE, **opts)
        for name in sq:
            sq[name] += _norm(np.asarray(getattr(sol, name), ORACLE) - np.asarray(getattr(base, name), ORACLE)) ** 2
    for name in sq:
        seen, said = np.sqrt(sq[name] / draws), h * _norm(base.moved[name])
        assert 0.8 < seen / said < 1.25, (name, seen, said)
