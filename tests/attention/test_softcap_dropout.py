"""softcap= and dropout_p=/dropout_seed= (issue 21): against the float64 oracle written from
their definitions, in both methods, through the backward, the layers and the checks."""
import numpy as np
import pytest

import qkv
from qkv import nn
from qkv.kernels import flash
from oracle import solve

METHODS = ("reference", "flash")
SMALL = flash.Tiles(rows=64, scratch=64 * 128, bwd_rows=32, bwd_keys=128, serial_work=1)


def _problem(seed=0, shape=(2, 4, 37, 16), tk=53, gqa=False, std=2.0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    hkv = shape[1] // 2 if gqa else shape[1]
    q = rng.standard_normal(shape) * std
    k = rng.standard_normal((shape[0], hkv, tk, shape[-1])) * std
    v = rng.standard_normal((shape[0], hkv, tk, shape[-1]))
    do = rng.standard_normal(shape)
    return tuple(x.astype(dtype) for x in (q, k, v, do))


OPTION_SETS = [
    dict(softcap=5.0),
    dict(softcap=50.0, causal=True, gqa=True),
    dict(softcap=2.0, causal="bottom_right", window=(9, 0), alibi=np.array([0.5, 0.25, 0.125, 0.0625])),
    dict(softcap=30.0, chunk=7, kv_lengths=np.array([40, 0])),
    dict(dropout_p=0.1, dropout_seed=12345),
    dict(dropout_p=0.5, dropout_seed=7, causal=True, gqa=True, q_lengths=np.array([30, 37])),
    dict(softcap=3.0, dropout_p=0.3, dropout_seed=-1, window=(5, 5), scale=0.7),
]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("opts", OPTION_SETS, ids=[" ".join(sorted(o)) for o in OPTION_SETS])
def test_float64_equals_the_oracle(method, opts):
    """Forward (out, lse, weights) and gradients to 1e-12 of the oracle's Σ|terms|."""
    opts = dict(opts)
    q, k, v, do = _problem(gqa=opts.get("gqa", False))
    rng = np.random.default_rng(3)
    opts_bias = dict(opts, bias=rng.standard_normal((1, 4, 37, 53)) * 3) if "kv_lengths" not in opts else opts
    want = solve(q, k, v, do, **opts_bias)
    out, lse, w = qkv.attention(q, k, v, return_lse=True, return_weights=True, method=method, **opts_bias)
    grads = qkv.attention_backward(do, q, k, v, out, lse, method=method, **opts_bias)
    for name, got in zip(("out", "lse", "weights", "dq", "dk", "dv"), (out, lse, w) + grads):
        ref, size = getattr(want, name), want.size.get(name, np.abs(getattr(want, name)))
        fin = np.isfinite(ref)
        assert (np.isfinite(got) == fin).all(), name
        assert np.abs(got[fin] - ref[fin]).max(initial=0) <= 1e-12 * max(1.0, float(np.abs(size[fin]).max())), name


def test_tiles_threads_and_methods_draw_one_mask():
    """The keep-mask and the numbers do not depend on the tiles, the threads or the method."""
    q, k, v, do = _problem(1, (1, 2, 300, 16), 333)
    opts = dict(softcap=4.0, dropout_p=0.25, dropout_seed=99, causal="bottom_right")
    out, lse = qkv.attention(q, k, v, return_lse=True, method="reference", **opts)
    want = qkv.attention_backward(do, q, k, v, out, lse, method="reference", **opts)
    from qkv.masks import build_spec
    spec = build_spec((1, 2), 300, 333, **{n: opts[n] for n in opts})
    for tiles in (None, SMALL):
        for threads in (1, 2):
            o, ls, _ = flash.forward(q, k, v, spec, 0.25, tiles=tiles, num_threads=threads)
            assert np.allclose(o, out, rtol=0, atol=1e-13) and np.allclose(ls, lse, rtol=0, atol=1e-13)
            got = flash.backward(do, q, k, v, out, lse, spec, 0.25, tiles=tiles, num_threads=threads)
            for g, w in zip(got, want):
                assert np.abs(g - w).max() <= 1e-12 * np.abs(w).max()


@pytest.mark.parametrize("method", METHODS)
def test_float32_within_the_error_budget(method):
    """float32 with softcap and dropout errs at most twice the plain float32 dense computation."""
    q, k, v, do = _problem(2, (1, 2, 200, 32), 260, std=3.0, dtype=np.float32)
    opts = dict(softcap=20.0, dropout_p=0.2, dropout_seed=5, causal=True)
    want, base = solve(q, k, v, do, **opts), solve(q, k, v, do, dtype=np.float32, **opts)
    out, lse = qkv.attention(q, k, v, return_lse=True, method=method, **opts)
    grads = qkv.attention_backward(do, q, k, v, out, lse, method=method, **opts)
    for name, got in zip(("out", "dq", "dk", "dv"), (out,) + grads):
        ref = getattr(want, name)
        err, floor = np.abs(got - ref).max(), np.abs(getattr(base, name) - ref).max()
        assert err <= 2 * floor + 4 * np.finfo(np.float32).eps * np.abs(ref).max(), (name, err, floor)


def test_same_seed_same_bits_and_p0_is_no_dropout():
    q, k, v, _ = _problem(4, dtype=np.float32)
    a = qkv.attention(q, k, v, dropout_p=0.3, dropout_seed=11, method="flash")
    assert np.array_equal(a, qkv.attention(q, k, v, dropout_p=0.3, dropout_seed=11, method="flash"))
    assert not np.array_equal(a, qkv.attention(q, k, v, dropout_p=0.3, dropout_seed=12, method="flash"))
    for method in METHODS:
        plain = qkv.attention(q, k, v, method=method)
        assert np.array_equal(plain, qkv.attention(q, k, v, dropout_p=0.0, dropout_seed=11, method=method))
        assert np.array_equal(plain, qkv.attention(q, k, v, dropout_p=0, method=method))
        assert np.array_equal(plain, qkv.attention(q, k, v, softcap=None, method=method))
        assert np.array_equal(plain, qkv.attention(q, k, v, softcap=0, method=method))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction_within_4_sigma(p):
    """Over 10⁶ weights (every (batch, head, row, column) its own draw) the kept fraction
    is within 4σ of 1 - p."""
    q, k = np.zeros((2, 4, 250, 4)), np.zeros((2, 4, 500, 4))
    _, w = qkv.attention(q, k, k, dropout_p=p, dropout_seed=2024, return_weights=True,
                         method="reference")
    n = w.size
    kept = np.count_nonzero(w) / n
    assert n == 10 ** 6 and abs(kept - (1 - p)) <= 4 * np.sqrt(p * (1 - p) / n)
    assert np.allclose(w[w != 0], 1 / 500 / (1 - p))


def test_mean_over_seeds_converges_to_the_undropped_output():
    q, k, v, _ = _problem(5, (1, 2, 8, 8), 16)
    plain = qkv.attention(q, k, v)
    mean = np.mean([qkv.attention(q, k, v, dropout_p=0.5, dropout_seed=s) for s in range(4000)], axis=0)
    # each output is a mean of 16 terms of std ~|v|: 4000 draws leave ~ 1/sqrt(4000) of it
    assert np.abs(mean - plain).max() < 0.08 and np.abs(mean - plain).mean() < 0.02


@pytest.mark.parametrize("method", METHODS)
def test_backward_equals_finite_differences(method):
    q, k, v, do = _problem(6, (1, 2, 6, 5), 7)
    opts = dict(softcap=1.5, dropout_p=0.4, dropout_seed=3, causal="bottom_right")
    out, lse = qkv.attention(q, k, v, return_lse=True, method=method, **opts)
    grads = qkv.attention_backward(do, q, k, v, out, lse, method=method, **opts)
    args = [q, k, v]
    for which, g in enumerate(grads):
        num = np.zeros_like(g)
        for idx in np.ndindex(*g.shape):
            vals = []
            for h in (1e-6, -1e-6):
                a = [x.copy() for x in args]
                a[which][idx] += h
                vals.append(float((qkv.attention(*a, method=method, **opts) * do).sum()))
            num[idx] = (vals[0] - vals[1]) / 2e-6
        assert np.abs(num - g).max() <= 1e-7 * max(1.0, np.abs(g).max())


def test_softcap_bounds_the_scores_and_auto_takes_a_kernel_that_has_both():
    """method='auto' takes the stacked kernel for plain scores only: with softcap or dropout
    (spec.plain_scores False) the row kernel (fast extra, float32) or the reference or the
    tiled kernel, which implement both."""
    from qkv import api
    q, k, v, _ = _problem(7, (16, 4, 128, 16), 128, std=30.0, dtype=np.float32)
    for opts in (dict(softcap=5.0), dict(dropout_p=0.1, dropout_seed=1)):
        for x in (q, q.astype(np.float64)):
            prob = api.prepare(x, k.astype(x.dtype), v.astype(x.dtype), **opts)
            assert not prob.spec.plain_scores
            assert api.choose_kernel("auto", prob, False).name in ("rows", "reference", "flash")
    assert api.prepare(q, k, v).spec.plain_scores
    _, lse = qkv.attention(q, k, v, softcap=5.0, return_lse=True)
    assert (lse <= 5.0 + np.log(128) + 1e-4).all()


@pytest.mark.parametrize("opts,match", [
    (dict(softcap=-1.0), "softcap must be a finite real number > 0"),
    (dict(softcap=float("nan")), "softcap must be a finite real number > 0"),
    (dict(softcap=float("inf")), "softcap must be"),
    (dict(softcap=True), "softcap must be"),
    (dict(dropout_p=1.0, dropout_seed=1), r"dropout_p must be a real number in \[0, 1\)"),
    (dict(dropout_p=-0.1, dropout_seed=1), "dropout_p must be"),
    (dict(dropout_p=float("nan"), dropout_seed=1), "dropout_p must be"),
    (dict(dropout_p=0.1), "needs dropout_seed="),
    (dict(dropout_p=0.1, dropout_seed=1.5), "dropout_seed must be an int"),
    (dict(dropout_p=0.1, dropout_seed=True), "dropout_seed must be an int"),
])
def test_bad_values_name_the_argument(opts, match):
    q = np.ones((3, 4))
    with pytest.raises(qkv.OptionError, match=match):
        qkv.attention(q, q, q, **opts)


def test_layer_dropout_only_in_training_and_its_backward_uses_the_forwards_mask():
    layer = nn.MultiHeadAttention(16, 4, causal=True, softcap=20.0, dropout=0.5, dtype=np.float64,
                                  rng=np.random.default_rng(0))
    plain = nn.MultiHeadAttention(16, 4, causal=True, softcap=20.0, dtype=np.float64, rng=np.random.default_rng(0))
    x = np.random.default_rng(1).standard_normal((2, 9, 16))
    layer.eval()
    assert np.array_equal(layer.forward(x), plain.eval().forward(x))
    layer.train()
    assert not np.allclose(layer.forward(x), plain.forward(x))
    dy = np.random.default_rng(2).standard_normal((2, 9, 16))

    def loss(xx):
        layer.rng = np.random.default_rng(42)  # the same seed each call
        return float((layer.forward(xx) * dy).sum())

    loss(x)
    dx = layer.backward(dy)
    i = (1, 4, 3)
    xp, xm = x.copy(), x.copy()
    xp[i] += 1e-6
    xm[i] -= 1e-6
    assert abs((loss(xp) - loss(xm)) / 2e-6 - dx[i]) < 1e-7
    with pytest.raises(qkv.OptionError, match="dropout_p must be"):
        nn.MultiHeadAttention(16, 4, dropout=1.5)


@pytest.mark.slow
@pytest.mark.parametrize("top", [0.3, 0.6249, 0.6251, 3.0, np.inf, np.nan])
def test_tiles_within_the_cap_take_tanhs_first_branch_with_the_same_bits(top):
    """A tile whose every |x / cap| is under tanh32's split runs its first branch alone
    (all_small): the same bits as tanh32 entry by entry, on both sides of the split, with
    inf and NaN; the forward and backward passes and the row kernel's rows alike."""
    from qkv import jit
    comp = jit.flash()
    if comp is None or jit.load(jit.ROWS) is None:
        pytest.skip("the compiled passes need the fast extra (numba) and QKV_JIT != 0")
    from qkv.kernels.rows import compiled as rows_compiled
    from qkv.kernels.flash.compiled import TSPLIT, all_small, tanh32

    cap = np.float32(50.0)
    rng = np.random.default_rng(0)
    st = (rng.uniform(-1, 1, (37, 19)) * 0.6 * cap).astype(np.float32)
    st[5, 7] = top * cap                                    # the tile's largest |x / cap|
    inv = np.float32(1) / cap
    want = np.array([[cap * tanh32(v * inv) for v in row] for row in st], np.float32)  # tanh32 alone, per entry
    if not np.isnan(top):  # with a NaN either branch gives NaN there (and the same elsewhere)
        assert all_small(st, inv) == bool(top < TSPLIT)
    got, g = st.copy(), np.empty_like(st)
    comp.softcap_tile(got, g, cap, True)
    np.testing.assert_array_equal(got, want)
    x = st[5].copy()                                        # a row of the row kernel
    slope = np.empty_like(x)
    rows_compiled._capped(x, inv, cap, slope, True)
    np.testing.assert_array_equal(x, want[5])


@pytest.mark.parametrize("drop", [False, True])
def test_the_backwards_score_gradient_pass_rounds_as_numpys_three_steps(drop):
    """A backward tile's ``dS = ((dO Vᵀ ∘ Z) - delta) ∘ f`` (f: P, or P ∘ (1 - tanh²) with
    softcap) and dV's ``P ∘ Z`` in one compiled pass: each step rounded as NumPy's ``*=``, ``+=``,
    ``*=`` and ``P * Z``, bit for bit, large, tiny, inf and NaN entries included; and a backward whose tiles take it (keys in
    several blocks) within float32's error of the float64 one."""
    from qkv import jit
    comp = jit.flash()
    if comp is None:
        pytest.skip("the compiled passes need the fast extra (numba) and QKV_JIT != 0")
    rng = np.random.default_rng(3)
    dst = (rng.standard_normal((67, 45)) * 10.0 ** rng.integers(-30, 30, (67, 45))).astype(np.float32)
    z = np.where(rng.random((67, 45)) < 0.2, 0, 1.25).astype(np.float32)
    f = rng.random((67, 45)).astype(np.float32)
    d = (rng.standard_normal(45) * 1e3).astype(np.float32)
    dst[0, :4] = [np.inf, -np.inf, np.nan, 3e38]
    d[5], f[7, 7] = np.nan, np.inf
    p = rng.random((67, 45)).astype(np.float32)
    p[3, 3] = np.nan
    want, want_z = dst.copy(), p * z
    with np.errstate(all="ignore"):
        if drop:
            want *= z
        want += d
        want *= f
        got, got_z = dst.copy(), z.copy()
        comp.scores_grad(got, got_z, d, f, p, drop)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_z, want_z if drop else z)   # z = P ∘ Z for dV where dropout is on

    opts = dict(softcap=20.0, causal=True) if not drop else dict(softcap=20.0, dropout_p=0.1, dropout_seed=4)
    q, k, v, do = (rng.standard_normal((1, 2, 1100, 32)).astype(np.float32) for _ in range(4))
    calls, real = [], comp.scores_grad
    try:
        comp.scores_grad = lambda *a: calls.append(1) or real(*a)
        out, lse = qkv.attention(q, k, v, method="flash", return_lse=True, **opts)
        grads = qkv.attention_backward(do, q, k, v, out, lse, method="flash", **opts)
    finally:
        comp.scores_grad = real
    assert calls
    x64 = [a.astype(np.float64) for a in (q, k, v, do)]
    o64, l64 = qkv.attention(*x64[:3], method="reference", return_lse=True, **opts)
    for got, want in zip(grads, qkv.attention_backward(x64[3], *x64[:3], o64, l64, method="reference", **opts)):
        np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max())
