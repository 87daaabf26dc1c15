"""The precise path's float64 tiles turned into P by compiled passes (qkv.kernels.flash.precise_compiled
and the tiled kernel's 2^x, through precise.exp_shifted): the subtraction pass gives NumPy's bits;
float32 P comes from the compiled 2^x (new bits, as close to the float64 oracle as NumPy's exp
made them); float64 keeps NumPy's bits; a row's largest score still gives P = 1 exactly."""
import warnings

import numpy as np
import pytest

import qkv
from qkv import jit
from qkv import threads as qkv_threads
from qkv.kernels.flash import backward_kernel, forward_kernel, precise


@pytest.fixture
def compiled():
    mod = jit.load(jit.PRECISE)
    if mod is None:
        pytest.skip("the compiled pass needs numba (the fast extra)")
    return mod


def _tile(rng, w, r):
    """A float64 score tile at realistic and extreme sizes: ±30 and more, masked keys (-inf),
    a NaN column, an inf, and entries whose difference leaves float32's range."""
    x = rng.standard_normal((w, r)) * 30
    x[:, 3] = -np.inf                       # a row that sees no key of this tile
    x[5, 4] = np.nan
    x[::7, 6] = -np.inf
    x[2, 7] = np.inf
    x[:, 8] = rng.standard_normal(w) * 1e300
    x[1, 9] = -0.0
    return x


def _numpy_shifted(x, m, out, n=None, f=1.0, unit=1.0):
    """What the precise path did before the pass: ``x *= f``, ``x -= m``, ``x -= n``, ``np.copyto``."""
    with np.errstate(over="ignore", invalid="ignore"):
        if f != 1.0:
            x *= f
        x -= m
        if n is not None:
            x -= n
        if unit != 1.0:
            x *= unit
        np.copyto(out, x)


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("two", [False, True], ids=["x - m", "(x - m) - log l"])
@pytest.mark.parametrize("f, unit", [(1.0, 1.0), (0.125, 1.0), (0.3, 1.0), (0.3, precise.LOG2E)])
@pytest.mark.parametrize("shape", [(1024, 512), (37, 5), (1, 1)])
def test_the_compiled_pass_gives_numpys_bits(compiled, dt, two, f, unit, shape):
    rng = np.random.default_rng(shape[0] + 2 * two)
    x = _tile(rng, 64, 16)[:shape[0], :shape[1]] if shape[0] < 64 else rng.standard_normal(shape) * 30
    if shape == (1024, 512):
        x[:64, :16] = _tile(rng, 64, 16)
    m = rng.standard_normal(x.shape[1]) * 30
    m[:1] = 0.0
    n = np.abs(rng.standard_normal(x.shape[1])) if two else None
    want = np.empty(x.shape, dt)
    _numpy_shifted(x.copy(), m, want, n, f, unit)
    got = np.full(x.shape, 7, dt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # an overflow to -inf is no warning
        compiled.shifted(x.copy(), f, m, n, unit, got)
    assert got.tobytes() == want.tobytes()


def test_a_difference_beyond_float32_is_minus_inf_and_its_exp_zero(compiled):
    x = np.array([[-1e300, 0.0, 5.0]])
    got = np.empty(x.shape, np.float32)
    compiled.shifted(x, 1.0, np.array([1e300, 0.0, 5.0]), None, 1.0, got)
    assert got[0, 0] == -np.inf and np.exp(got[0, 0]) == 0.0
    assert got[0, 1] == 0.0 and got[0, 2] == 0.0


def test_shifted_without_the_fast_extra_gives_the_same_bits_and_no_warning(compiled, monkeypatch):
    rng = np.random.default_rng(4)
    x, m, n = _tile(rng, 64, 16), rng.standard_normal(16) * 30, np.abs(rng.standard_normal(16))
    fast, slow = np.empty(x.shape, np.float32), np.empty(x.shape, np.float32)
    precise.shifted(x.copy(), m, fast, n, 0.3)
    monkeypatch.setitem(jit._loaded, jit.PRECISE, None)      # as without the fast extra
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)        # the overflow to -inf warns no more
        with np.errstate(invalid="ignore"):                   # inf - inf of the tile's inf entry, as before
            precise.shifted(x.copy(), m, slow, n, 0.3)
    assert fast.tobytes() == slow.tobytes()


def _inputs(rng, shape, kv_shape, dt=np.float32, mag=2.5):
    q = (rng.standard_normal(shape) * mag).astype(dt)
    k = (rng.standard_normal(kv_shape) * mag).astype(dt)
    v = rng.standard_normal(kv_shape).astype(dt)
    do = rng.standard_normal(shape).astype(dt)
    return q, k, v, do


CALLS = [  # (name, q shape, kv shape, options): inputs x 2.5, scores of ±25 and more
    ("full", (1, 2, 1500, 64), (1, 2, 1500, 64), {}),
    ("D 48, scale 1/sqrt(48)", (1, 2, 1300, 48), (1, 2, 1300, 48), dict(causal=True)),
    ("scale 0.3", (1, 2, 1100, 16), (1, 2, 1100, 16), dict(scale=0.3, mag=3.0)),
    ("causal", (1, 2, 1500, 64), (1, 2, 1500, 64), dict(causal=True)),
    ("gqa lengths", (2, 4, 1100, 32), (2, 2, 1100, 32),
     dict(gqa=True, causal=True, kv_lengths=np.array([1100, 400]), q_lengths=np.array([1100, 300]))),
    ("float64", (1, 2, 1100, 64), (1, 2, 1100, 64), dict(causal=True, dtype=np.float64)),
    ("softcap", (1, 2, 1100, 64), (1, 2, 1100, 64), dict(causal=True, softcap=30.0)),
    ("dropout", (1, 2, 1100, 64), (1, 2, 1100, 64), dict(dropout_p=0.1, dropout_seed=5)),
    ("bias -1e30", (1, 2, 1100, 64), (1, 2, 1100, 64), dict(bias="far")),
    ("scores 1e4", (1, 2, 1100, 64), (1, 2, 1100, 64), dict(mag=40.0)),
]


def _call(q, k, v, do, opts, threads, monkeypatch):
    monkeypatch.setitem(qkv_threads._state, "threads", threads)
    out, lse = qkv.attention(q, k, v, method="flash", return_lse=True, **opts)
    return [out, lse, *qkv.attention_backward(do, q, k, v, out, lse, method="flash", **opts)[:3]]


def _oracle(q, k, v, do, opts):
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
    out, lse = qkv.attention(q64, k64, v64, method="reference", return_lse=True, **opts)
    return [out, lse, *qkv.attention_backward(do64, q64, k64, v64, out, lse, method="reference", **opts)[:3]]


@pytest.mark.parametrize("name, shape, kv_shape, opts", CALLS, ids=[c[0] for c in CALLS])
def test_precise_calls_on_the_compiled_passes(compiled, monkeypatch, name, shape, kv_shape, opts):
    """Forward and backward on the compiled passes against NumPy's (each pass counted: it ran):
    float64 bit for bit; float32 as close to the float64 oracle as NumPy's exp made it (at most
    1.5x its error plus 2 ulps of the result); the forward's bits the same at 1 and 2 threads."""
    opts = dict(opts)
    rng = np.random.default_rng(len(name))
    dt = opts.pop("dtype", np.float32)
    q, k, v, do = _inputs(rng, shape, kv_shape, dt, opts.pop("mag", 2.5))
    if opts.get("bias") == "far":
        bias = np.where(rng.random(shape[-2:-1] + kv_shape[-2:-1]) < 0.3, -1e30, 0.0)
        bias[7] = -1e30                     # a row that sees only such keys
        opts["bias"] = bias
    ran = {"forward": 0, "backward": 0}
    real = precise.exp_shifted

    def counted(where):
        def exp_shifted(*a, **kw):
            ran[where] += jit._loaded.get(jit.PRECISE) is not None
            return real(*a, **kw)
        return exp_shifted
    monkeypatch.setattr(forward_kernel, "exp_shifted", counted("forward"))
    monkeypatch.setattr(backward_kernel, "exp_shifted", counted("backward"))
    got = _call(q, k, v, do, opts, 1, monkeypatch)
    assert ran["forward"] > 0 and ran["backward"] > 0, f"the precise path did not take the passes: {ran}"
    again = _call(q, k, v, do, opts, 2, monkeypatch)
    for label, g, a in zip(["out", "lse"], got, again):
        assert g.tobytes() == a.tobytes(), f"{label} differs between 1 and 2 threads"
    with monkeypatch.context() as m:
        m.setitem(jit._loaded, jit.PRECISE, None)             # NumPy's passes and exp, as before
        want = _call(q, k, v, do, opts, 1, monkeypatch)
    if dt == np.float64:
        for label, g, w in zip(["out", "lse", "dq", "dk", "dv"], got, want):
            assert g.tobytes() == w.tobytes(), f"{label} differs"
        return
    if "dropout_p" in opts:                 # the oracle has no dropout: the two paths against each other
        for label, g, w in zip(["out", "lse", "dq", "dk", "dv"], got, want):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * max(np.abs(w).max(), 1), err_msg=label)
        return
    exact = _oracle(q, k, v, do, opts)
    for label, g, w, x in zip(["out", "lse", "dq", "dk", "dv"], got, want, exact):
        fin = np.isfinite(x)
        assert np.array_equal(np.isfinite(g), fin), label
        err_got, err_want = (np.abs(y[fin].astype(np.float64) - x[fin]).max() for y in (g, w))
        floor = 2 * np.finfo(np.float32).eps * np.abs(x[fin]).max()
        assert err_got <= 1.5 * err_want + floor, f"{label}: {err_got:.3g} against NumPy's exp {err_want:.3g}"
