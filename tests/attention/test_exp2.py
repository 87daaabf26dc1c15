"""The score tiles' exponential: every path close to 1 ulp, exactly 0 below the underflow
limit, NaN kept, never negative; QKV_JIT=0 turns the compiled path off; import qkv stays light."""
import os
import subprocess
import sys

import numpy as np
import pytest

from qkv.kernels.flash import exp2 as E


def tile(seed=1):
    x = np.random.default_rng(seed).uniform(-140, 100, (300, 257)).astype(np.float32)
    x[0, :6] = [-np.inf, np.nan, -127, -126.5, 0, 1]
    return x


def check(y, x, m=0.0, scaled=False, flushed=True):
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        _check(y, x, m, scaled, flushed)


def _check(y, x, m, scaled, flushed):
    ref = np.exp2(x.astype(np.float64) - m)
    normal = np.isfinite(ref) & (ref >= 2.0 ** -126)
    # 2 ulp of exp's own error; the float32 argument x - m may carry one rounding of its own
    arg_err = np.abs(np.float32(x) - np.float32(m) - (x.astype(np.float64) - m)) * np.log(2)
    if scaled:  # np.exp(x · ln 2): the product is rounded to float32 once more
        arg_err = arg_err + np.abs(x - m) * np.log(2) * 2.0 ** -24
    rel = np.abs(y[normal] - ref[normal]) / ref[normal]
    assert (rel <= 2.5e-7 + 1.01 * arg_err[normal]).all(), rel.max()
    if flushed:  # the compiled pass: exactly 0 below the limit (NumPy keeps subnormals there)
        assert (y[x - m <= -127] == 0).all()
    assert (y[x - m <= -127] < 2.0 ** -126).all()
    assert not (y < 0).any()
    assert np.isnan(y[np.isnan(x)]).all() and not np.isnan(y[~np.isnan(x)]).any()


def test_the_chosen_path_is_accurate():
    x = tile()
    y = x.copy()
    E.exp2(y)
    compiled = E.path() == "numba"
    check(y, x, scaled=E.path() == "numpy exp", flushed=compiled)
    m = np.random.default_rng(2).uniform(0, 50, x.shape[1]).astype(np.float32)
    z = x.copy()
    E.sub_exp2(z, m)
    check(z, x, m, scaled=E.path() == "numpy exp", flushed=compiled)


@pytest.mark.parametrize("fn", [E._np_exp2, E._np_exp])
def test_the_numpy_paths_are_accurate(fn):
    x = tile(3)
    y = x.copy()
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        fn(y)
    check(y, x, scaled=fn is E._np_exp, flushed=False)


def test_float64_tiles_take_numpy_exp2():
    x = np.linspace(-1000, 50, 999).reshape(27, 37)
    y = x.copy()
    E.exp2(y)
    np.testing.assert_allclose(y, np.exp2(x), rtol=1e-15)


def test_path_is_numba_where_installed_and_off_with_qkv_jit_0():
    code = "from qkv.kernels.flash import exp2; print(exp2.path())"
    env = dict(os.environ, QKV_JIT="0")
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert off.stdout.strip() in ("numpy exp2", "numpy exp")
    try:
        import numba  # noqa: F401
    except ImportError:
        pytest.skip("numba is not installed (pip install -e '.[fast]')")
    env = {k: v for k, v in os.environ.items() if k != "QKV_JIT"}
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert on.stdout.strip() == "numba"


def test_import_qkv_does_not_import_numba():
    code = "import sys, qkv; print('numba' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


@pytest.mark.parametrize("lo,hi,shift", [(None, 0, 0), (5, 0, 3), (4, 7, -2), (None, None, 1), (0, 0, 0)])
def test_the_band_is_masked_in_the_same_pass(lo, hi, shift):
    x = np.random.default_rng(4).uniform(-20, 5, (40, 24)).astype(np.float32)
    m = np.random.default_rng(5).uniform(0, 3, 24).astype(np.float32)
    k0, r0 = 10, 7
    y = x.copy()
    if not E.band_sub_exp2(y, m, k0, r0, shift, lo, hi):
        pytest.skip("the compiled path is off (numba missing or QKV_JIT=0): callers mask with -inf instead")
    key = k0 + np.arange(40)[:, None]
    row = r0 + np.arange(24)[None, :] + shift
    inside = (key >= row - (lo if lo is not None else 10**9)) & (key <= row + (hi if hi is not None else 10**9))
    want = np.where(inside, np.exp2(x.astype(np.float64) - m), 0)
    np.testing.assert_allclose(y, want, rtol=1e-6)
    assert (y[~inside] == 0).all()


@pytest.mark.parametrize("offset", [True, False])
def test_column_sums_ride_in_the_same_pass(offset):
    """``l`` gets each column's sum added (the softmax denominators), on every path."""
    x = np.random.default_rng(6).uniform(-30, 4, (70, 33)).astype(np.float32)
    m = np.random.default_rng(7).uniform(0, 3, 33).astype(np.float32) if offset else None
    l = np.full(33, 0.25, np.float32)
    y = x.copy()
    E.sub_exp2(y, m, l)
    want = np.exp2(x.astype(np.float64) - (0 if m is None else m))
    np.testing.assert_allclose(y, want, rtol=4e-6)  # x - m rounded to float32 first: |x| eps ln 2
    np.testing.assert_allclose(l, 0.25 + want.sum(axis=0), rtol=4e-6)
    lb = np.zeros(33, np.float32)
    z = x.copy()
    if E.band_sub_exp2(z, np.zeros(33, np.float32), 0, 0, 0, 3, 0, l=lb):  # compiled: sums of the band only
        np.testing.assert_allclose(lb, z.sum(axis=0, dtype=np.float64), rtol=2e-6)
        assert (z[np.arange(70)[:, None] > np.arange(33)[None, :]] == 0).all()


@pytest.mark.parametrize("rows", [1, 3, 4, 70, 259])
def test_the_compiled_pass_has_row_by_rows_bits(rows):
    """The compiled pass takes four rows a loop (their exponentials interleaved) and adds them
    to the float64 sums one row at a time, in order: every entry is pow2 of its own argument, as
    the flat exp2 pass gives it, and every sum the row-by-row float64 sum, bit for bit (rows not
    a multiple of 4 included, inf, -inf and NaN among them)."""
    from qkv import jit
    c = jit.flash()
    if c is None:
        pytest.skip("the fast extra (numba) is not installed, or QKV_JIT=0")
    rng = np.random.default_rng(rows)
    x = rng.uniform(-140, 90, (rows, 37)).astype(np.float32)
    x[0, :3] = [np.inf, -np.inf, np.nan]
    m = rng.uniform(-3, 30, 37).astype(np.float32)
    l = rng.uniform(0, 2, 37)
    y, got = x.copy(), l.copy()
    c.sub_exp2_sum(y, m, got)
    want = (x - m).astype(np.float32)
    c.exp2(want)
    assert np.array_equal(y.view(np.uint32), want.view(np.uint32))
    sums = l.copy()
    with np.errstate(invalid="ignore"):
        for i in range(rows):
            sums += want[i].astype(np.float64)
    assert np.array_equal(got, sums, equal_nan=True)


@pytest.mark.slow
def test_compiled_once_per_machine():
    """The second process loads the passes from numba's on-disk cache: nothing is compiled again."""
    pytest.importorskip("numba", reason="numba is not installed (pip install -e '.[fast]')")
    code = ("from qkv.kernels.flash import exp2, compiled as c; exp2.path(); "
            "fs = (c.sub_exp2_sum, c.exp2, c.band_exp2_sum); "
            "print(sum(sum(f.stats.cache_hits.values()) for f in fs), "
            "sum(sum(f.stats.cache_misses.values()) for f in fs))")
    env = {k: v for k, v in os.environ.items() if k != "QKV_JIT"}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    hits, misses = map(int, runs[1].stdout.split())
    assert (hits, misses) == (3, 0), runs[1].stdout
