"""Huge finite inputs whose answer fits the dtype (qkv.kernels.magnitudes): q·k overflowing
before the scale, v near the top of the dtype, and a huge key a row may not see, on every
kernel, against the float64 oracle."""
import warnings

import numpy as np
import pytest

import oracle
from qkv import api, jit
from qkv.kernels import magnitudes, stacked
from qkv.kernels.rows import kernel as rows, numpy_rows as rows_numpy

RESULTS = ("out", "lse", "dq", "dk", "dv")


def kernels() -> dict:
    """Every float32 kernel by name (the compiled row kernel where the fast extra is on)."""
    found = {"rows": api.ROWS} if jit.load(jit.ROWS_FUSED) is not None else {}
    found.update({"rows-numpy": api.ROWS_NUMPY, "stacked": api.STACKED, "flash": "flash",
                  "reference": "reference", "auto": "auto"})
    return found


KERNELS = kernels()


def takes(name: str, spec) -> bool:
    """Whether kernel ``name`` runs problems with this mask (the dense and tiled ones run all)."""
    return {"stacked": lambda: stacked.applies(spec), "rows-numpy": lambda: rows_numpy.applies(spec, np.float32),
            "rows": lambda: rows.applies(spec, np.float32)}.get(name, lambda: True)()


def run(name, q, k, v, dout, **opts) -> dict:
    """out, lse and the gradients of one kernel, through the public call's checks and sum-back;
    a warning (overflow, invalid) fails the test."""
    kern = KERNELS[name]
    prob = api.prepare(q, k, v, **opts)
    call = api.Prepared(prob, api.choose_kernel(kern, prob) if isinstance(kern, str) else kern)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = call.forward(return_lse=True)
        return dict(zip(RESULTS, (out, lse) + call.backward(dout, out, lse)))


def close(got: dict, want, rtol=1e-5) -> None:
    """Each result finite and within ``rtol`` of the oracle's (relative to the array's largest)."""
    for name, w in zip(RESULTS, want):
        g = got[name]
        assert np.isfinite(g).all(), name
        scale = max(float(np.abs(w).max()), np.finfo(np.float32).tiny)
        assert np.abs(g.astype(np.float64) - w).max() <= rtol * scale, (name, np.abs(g - w).max(), scale)


def want(q, k, v, dout, **opts) -> tuple:
    sol = oracle.solve(q, k, v, dout, **opts)
    return sol.out, sol.lse, sol.dq, sol.dk, sol.dv


@pytest.mark.parametrize("name", list(KERNELS))
def test_q_k_overflowing_before_the_scale(name):
    """q·k = 4e38 overflows float32, the scaled scores 1e38 do not: every kernel gives the
    oracle's out, lse and gradients (they gave NaN on all but the tiled and NumPy row kernels)."""
    rng = np.random.default_rng(0)
    q = np.full((1, 1, 4, 4), 1e19, np.float32)
    q[..., 1:, :] *= rng.uniform(0.5, 1, (3, 4)).astype(np.float32)     # rows of other sizes
    v, dout = (rng.standard_normal((1, 1, 4, 4)).astype(np.float32) for _ in range(2))
    got = run(name, q, q, v, dout, scale=0.25)
    assert np.isfinite(got["lse"]).all() and got["lse"].max() > 1e37
    out, lse, *_ = want(q, q, v, dout, scale=0.25)
    assert np.allclose(got["out"], out, rtol=1e-5, atol=1e-6) and np.allclose(got["lse"], lse, rtol=1e-6)
    for g in ("dq", "dk", "dv"):
        assert np.isfinite(got[g]).all(), g


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("tk, size", [(2048, 1e36), (1024, 3e35)])
def test_huge_finite_values_forward(name, tk, size):
    """v near the top of float32: out is v's mean-like average (1e36), not inf, and no warning
    (the tiled and NumPy row kernels summed before normalising)."""
    rng = np.random.default_rng(1)
    q, k = (rng.standard_normal((1, 1, tk, 8)).astype(np.float32) for _ in range(2))
    v = (size * rng.uniform(0.5, 1, (1, 1, tk, 8))).astype(np.float32)
    kern = KERNELS[name]
    prob = api.prepare(q, k, v, causal=True)
    call = api.Prepared(prob, api.choose_kernel(kern, prob) if isinstance(kern, str) else kern)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = call.forward()
    ref = oracle.solve(q, k, v, causal=True).out
    assert np.isfinite(out).all() and np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("name", list(KERNELS))
def test_huge_finite_values_backward(name):
    """v = 1e37, Dv = 64, dO = 1: dP and delta are each past float32 (inf - inf gave NaN in dq
    and dk on every kernel); the float64 gradients fit float32."""
    rng = np.random.default_rng(2)
    q, k = (rng.standard_normal((1, 2, 48, 64)).astype(np.float32) for _ in range(2))
    v = (1e37 * rng.uniform(0.5, 1, (1, 2, 48, 64))).astype(np.float32)
    dout = np.ones_like(v)
    got = run(name, q, k, v, dout, causal=True)
    close(got, want(q, k, v, dout, causal=True), rtol=1e-4)


HIDDEN = {"bias": lambda t: dict(bias=np.where(_hidden(t), -np.inf, 0).astype(np.float32)),
          "causal": lambda t: dict(causal=True), "mask": lambda t: dict(mask=~_hidden(t))}


def _hidden(t: int) -> np.ndarray:
    """(T, T): rows 0-1 may not see key 2 (nor, for causal's sake, the keys after it)."""
    h = np.zeros((t, t), bool)
    h[:2, 2:] = True
    return h


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("how", list(HIDDEN))
def test_a_huge_hidden_key(name, how):
    """k = 1e38, v = -1e38 at key 2, which rows 0 and 1 may not see (a -inf bias, causal or a
    mask): those rows' out, lse and dq are the oracle's, finite (NaN before: the dense
    kernels' q·k overflowed into inf + -inf, and every kernel's dP into 0 · inf)."""
    t = 16
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal((1, 1, t, 4)).astype(np.float32) for _ in range(4))
    k[..., 2, :], v[..., 2, :] = 1e38, -1e38
    opts = HIDDEN[how](t)
    kern = KERNELS[name]
    prob = api.prepare(q, k, v, **opts)
    if not takes(name, prob.spec):
        pytest.skip(f"{name} does not take {how}")
    call = api.Prepared(prob, api.choose_kernel(kern, prob) if isinstance(kern, str) else kern)
    with np.errstate(over="ignore"):  # rows 2-15 see the key: their dS k (1e31 of rounding times 1e38) may overflow
        out, lse = call.forward(return_lse=True)
        dq = call.backward(dout, out, lse)[0]
    ref = oracle.solve(q, k, v, dout, **opts)
    for got, w in ((out, ref.out), (lse[..., None], ref.lse[..., None]), (dq, ref.dq)):
        assert np.isfinite(got[..., :2, :]).all()
        assert np.allclose(got[..., :2, :], w[..., :2, :], rtol=1e-5, atol=1e-6)


def test_ordinary_inputs_are_not_scaled():
    """At ordinary magnitudes every exponent is 0: the kernel is called as it was (same bits)."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((4, 8, 256, 64)).astype(np.float32) * 30 for _ in range(3))
    prob = api.prepare(q, k, v)
    assert magnitudes.q_exponent(q, k, prob.scale) == 0
    assert magnitudes.v_exponent(v, 256) == 0
    assert magnitudes.dout_exponent(v, v, None, prob.spec, 1) == 0
    # and each exponent is the least that brings its bound under the dtype's top
    big = np.full((1, 1, 4, 4), 1e19, np.float32)
    eq = magnitudes.q_exponent(big, big, 0.25)
    top = float(np.finfo(np.float32).max) * magnitudes.HEADROOM
    bound = 4 * 1e19 * 1e19                 # D·max|q|·max|k|: Σq² itself overflowed
    assert bound * 2.0 ** -eq <= top < bound * 2.0 ** (1 - eq)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_a_strided_views_square_sum_is_one_pass_and_says_what_is_not_finite(monkeypatch, dtype):
    """A head cut out of a fused projection ``(B, T, 3, H, D)`` (Hugging Face's and the layers'
    layout): ``Σx²`` over the view in place, as the contiguous copy's to the dtype's rounding, no
    max or min taken where it is finite; a NaN or inf entry, or a sum that overflows, is not finite,
    and the bound then comes from the max and the min as before."""
    rng = np.random.default_rng(7)
    fused = (rng.standard_normal((3, 40, 3, 4, 16)) * (1 if dtype == np.float16 else 3)).astype(dtype)
    x = fused[:, :, 1].transpose(0, 2, 1, 3)                       # (3, 4, 40, 16), not contiguous
    assert not x.flags.c_contiguous
    want = float(np.sum(np.ascontiguousarray(x).astype(np.float64) ** 2))
    rel = 640 * float(np.finfo(dtype).eps)                         # a sum of 7680 squares in the dtype
    assert magnitudes.square_sum(x) == pytest.approx(want, rel=rel)
    monkeypatch.setattr(magnitudes, "abs_max", lambda a: pytest.fail("a finite view took the max and min"))
    assert magnitudes.norm_bound(x) == pytest.approx(np.sqrt(want), rel=rel)
    monkeypatch.undo()
    for bad in (np.nan, np.inf, -np.inf, float(np.finfo(dtype).max)):
        y = fused.copy()
        y[2, 7, 1, 3, 5] = bad
        view = y[:, :, 1].transpose(0, 2, 1, 3)
        assert not np.isfinite(magnitudes.square_sum(view))
        got = magnitudes.norm_bound(view)
        if np.isnan(bad):
            assert np.isnan(got)
        else:                                                     # sqrt(D) max|x|, in float64
            assert got == pytest.approx(4.0 * abs(float(np.asarray(bad, dtype))))


@pytest.mark.parametrize("sign", [1, -1])
def test_a_hidden_key_whose_score_overflows_the_dtype(sign):
    """A -inf bias hides a key whose scaled score is itself past float32 (±inf): the row that
    may not see it keeps the oracle's finite results (the dense path made inf + -inf = NaN)."""
    t = 16
    rng = np.random.default_rng(5)
    q, k, v, dout = (rng.standard_normal((1, 1, t, 4)).astype(np.float32) for _ in range(4))
    q *= 10
    k[..., 2, :] = sign * np.sign(q[0, 0, 0]) * 3e38
    bias = np.where(_hidden(t), -np.inf, 0).astype(np.float32)
    prob = api.prepare(q, k, v, bias=bias)
    call = api.Prepared(prob, api.choose_kernel("reference", prob))
    with np.errstate(over="ignore", invalid="ignore"):   # rows 2-15 see the key: their scores are past float32
        out, lse = call.forward(return_lse=True)
        dq = call.backward(dout, out, lse)[0]
    ref = oracle.solve(q, k, v, dout, bias=bias)
    for got, w in ((out, ref.out), (lse[..., None], ref.lse[..., None]), (dq, ref.dq)):
        assert np.allclose(got[..., :2, :], w[..., :2, :], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", [n for n in KERNELS if n != "auto"])
def test_hidden_future_keys_change_no_bit(name):
    """causal: setting the keys rows 0-299 may not see to k = +100, v = -100 leaves those rows'
    out, lse and dq bit for bit (the NumPy row kernel redid a whole block with each row's own
    max where one row of it saw the large keys, moving the others by an ulp)."""
    rng = np.random.default_rng(6)
    t, t0 = 600, 300
    q, k, v, dout = (rng.standard_normal((1, 2, t, 16)).astype(np.float32) for _ in range(4))
    k2, v2 = k.copy(), v.copy()
    k2[..., t0:, :], v2[..., t0:, :] = 100, -100
    with np.errstate(over="ignore"):
        a, b = run(name, q, k, v, dout, causal=True), run(name, q, k2, v2, dout, causal=True)
    for res in ("out", "lse", "dq"):
        rows = (slice(None), slice(None), slice(0, t0))             # (B, H, rows 0-299)
        assert np.array_equal(a[res][rows], b[res][rows]), res


# Masks whose rows see a run of keys; (Tq, Tk) = T + the two numbers (T: 600 or 2048); whether
# some rows do not see the first keys either (their runs start later).
RUNS = {"causal": (dict(causal=True), 0, 0, False),
        "top_left Tk > Tq": (dict(causal="top_left"), 0, 100, False),
        "bottom_right Tq < Tk": (dict(causal="bottom_right"), -150, 0, False),
        "window": (dict(window=(128, 16)), 0, 0, True),
        "chunk gqa": (dict(causal=True, chunk=128, gqa=True), 0, 0, True)}


@pytest.mark.parametrize("name,t", [("flash", 600), ("flash", 2048), ("reference", 600),
                                    pytest.param("reference", 2048, marks=pytest.mark.slow)])
@pytest.mark.parametrize("how", list(RUNS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", [0, 1])
def test_hidden_keys_change_no_bit_of_the_rows_blind_to_them(name, how, t, dtype, seed):
    """The late keys (from Tk/2), and the early ones (below Tk/8) where some rows do not see
    them, set to k = +100 (seed 0) or 100·N(0, 1) (seed 1), v = -100: every row that sees none
    of them keeps its out, lse and dq bit for bit (issue 51: the tiled kernel's offsets and
    paths were chosen from the largest key of a task or head, hidden keys included, and per
    task rather than per row)."""
    opts, dq_, dk_, early = RUNS[how]
    tq, tk = t + dq_, t + dk_
    rng = np.random.default_rng(seed)
    hkv = 1 if opts.get("gqa") else 2
    q, dout = (rng.standard_normal((1, 2, tq, 16)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((1, hkv, tk, 16)).astype(dtype) for _ in range(2))
    changed = np.zeros(tk, bool)
    changed[tk // 2:] = True
    changed[:tk // 8] = early
    k2, v2 = k.copy(), v.copy()
    k2[..., changed, :] = 100 if seed == 0 else 100 * rng.standard_normal((1, hkv, changed.sum(), 16))
    v2[..., changed, :] = -100
    seen = api.prepare(q, k, v, **opts).spec.allowed(index=(0, 0))   # (Tq, Tk): True = may attend
    blind = ~(seen & changed).any(axis=1)
    assert 0 < blind.sum() < tq
    with np.errstate(over="ignore"):
        a, b = run(name, q, k, v, dout, **opts), run(name, q, k2, v2, dout, **opts)
    for res in ("out", "lse", "dq"):
        assert np.array_equal(a[res][:, :, blind], b[res][:, :, blind]), res


def _tril(t: int) -> np.ndarray:
    return np.tril(np.ones((t, t), bool))


OTHERS = {"mask": lambda t: dict(mask=_tril(t) & (np.random.default_rng(9).random((t, t)) > 0.3)),
          "-inf bias": lambda t: dict(bias=np.where(_tril(t), 0, -np.inf).astype(np.float32)),
          "alibi": lambda t: dict(causal=True, alibi=np.array([0.5, -0.01])),
          "softcap": lambda t: dict(causal=True, softcap=5.0),
          "dropout": lambda t: dict(causal=True, dropout_p=0.2, dropout_seed=3, softcap=30.0)}


@pytest.mark.parametrize("how", list(OTHERS))
def test_hidden_keys_change_no_bit_under_masks_biases_and_score_options(how):
    """As above on the tiled kernel, the future hidden by a user mask, a -inf bias, or causal
    beside ALiBi, softcap and dropout."""
    t, t0 = 600, 300
    rng = np.random.default_rng(7)
    q, k, v, dout = (rng.standard_normal((1, 2, t, 16)).astype(np.float32) for _ in range(4))
    k2, v2 = k.copy(), v.copy()
    k2[..., t0:, :], v2[..., t0:, :] = 100, -100
    with np.errstate(over="ignore"):
        a, b = run("flash", q, k, v, dout, **OTHERS[how](t)), run("flash", q, k2, v2, dout, **OTHERS[how](t))
    for res in ("out", "lse", "dq"):
        assert np.array_equal(a[res][:, :, :t0], b[res][:, :, :t0]), res
