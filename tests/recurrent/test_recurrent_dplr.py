"""The chunked dplr recurrence (qkv.recurrent.generalized_delta.chunk, RWKV-7's generalized delta rule) against
the float64 step oracle, central finite differences, and flash-linear-attention's
``dplr_recurrence`` (forward, and gradients through torch autograd)."""
import numpy as np
import pytest

import qkv.recurrent as rec
from qkv.errors import ShapeError
from qkv.recurrent import steps
from qkv.recurrent.generalized_delta import chunk as dplr, chunk_parts as dplr_chunk, naive as R

from fla_reference import naive


def _inputs(rng, B, H, T, Dk, Dv, *, per_head, kind, strong=False):
    """``(q, k, v, a, b, g)`` float64. kind "rwkv": a = -κ̂, b = κ̂ ∘ α (κ̂ unit, α in (0, 1));
    "generic": a, b random of moderate size. strong: decays down to -30 a step on some steps."""
    q, k, v = rng.standard_normal((B, H, T, Dk)), rng.standard_normal((B, H, T, Dk)), rng.standard_normal((B, H, T, Dv))
    if kind == "rwkv":
        kh = rng.standard_normal((B, H, T, Dk))
        kh /= np.linalg.norm(kh, axis=-1, keepdims=True)
        a, b = -kh, kh * rng.uniform(0, 1, (B, H, T, Dk))
    else:
        a, b = 0.5 * rng.standard_normal((B, H, T, Dk)), 0.5 * rng.standard_normal((B, H, T, Dk))
    shape = (B, H, T) if per_head else (B, H, T, Dk)
    g = -rng.uniform(0, 1, shape)
    if strong:
        g = np.where(rng.uniform(0, 1, shape) < 0.3, -rng.uniform(0, 30, shape), g)
        g.flat[::7] = -30.0
    return q, k, v, a, b, g


def _max_err(xs, ys):
    return max(np.abs(np.asarray(x) - np.asarray(y)).max(initial=0.0) for x, y in zip(xs, ys))


CASES = [(per_head, kind, strong) for per_head in (False, True) for kind in ("rwkv", "generic")
         for strong in (False, True)]


@pytest.mark.parametrize("T", [1, 5, 64, 100, 257])
@pytest.mark.parametrize("chunk", [1, 3, 16, 64, None])
def test_chunked_equals_oracle_float64(T, chunk):
    """Outputs, final state and all seven gradients, to 1e-10, over both decay shapes, both
    input kinds, mild and strong (to -30) decays, with and without initial_state and dstate."""
    rng = np.random.default_rng(T * 100 + (chunk or 0))
    if chunk == 1 and T == 257:
        T = 130                                            # the step form itself: keep the suite fast
    for i, (per_head, kind, strong) in enumerate(CASES):
        q, k, v, a, b, g = _inputs(rng, 1, 2, T, 5, 3, per_head=per_head, kind=kind, strong=strong)
        S0 = rng.standard_normal((1, 2, 5, 3)) if i % 2 else None
        dS = rng.standard_normal((1, 2, 5, 3)) if i % 4 < 2 else None
        kw = dict(scale=0.6, initial_state=S0)
        o, S = dplr.forward(q, k, v, a, b, g, chunk=chunk, **kw)
        o_ref, S_ref = R.dplr_forward(q, k, v, a, b, g, **kw)
        scale_o = max(1.0, np.abs(o_ref).max())
        assert _max_err([o, S], [o_ref, S_ref]) <= 1e-10 * scale_o, (per_head, kind, strong)
        do = rng.standard_normal(o.shape)
        grads = dplr.backward(do, dS, q, k, v, a, b, g, chunk=chunk, **kw)
        refs = R.dplr_backward(do, dS, q, k, v, a, b, g, **kw)
        for name, got, ref in zip("q k v a b g S0".split(), grads, refs):
            assert got.shape == ref.shape, name
            assert _max_err([got], [ref]) <= 1e-10 * max(1.0, np.abs(ref).max()), (name, per_head, kind, strong)


@pytest.mark.parametrize("elements", [1, 200])
def test_groups_of_chunks(monkeypatch, elements):
    """The chunks taken a group at a time (one chunk a group; several, the last one partial)."""
    monkeypatch.setattr(dplr_chunk, "GROUP_ELEMENTS", elements)
    rng = np.random.default_rng(elements)
    for chunk, per_head in ((3, False), (16, True), (5, False)):
        q, k, v, a, b, g = _inputs(rng, 1, 2, 100, 5, 3, per_head=per_head, kind="rwkv", strong=True)
        S0, dS = rng.standard_normal((1, 2, 5, 3)), rng.standard_normal((1, 2, 5, 3))
        assert len(dplr_chunk.groups(100, chunk, 2, 5)) > 1
        kw = dict(scale=0.6, initial_state=S0)
        assert _max_err(dplr.forward(q, k, v, a, b, g, chunk=chunk, **kw), R.dplr_forward(q, k, v, a, b, g, **kw)) < 1e-10
        do = rng.standard_normal(v.shape)
        assert _max_err(dplr.backward(do, dS, q, k, v, a, b, g, chunk=chunk, **kw),
                        R.dplr_backward(do, dS, q, k, v, a, b, g, **kw)) < 1e-10


def test_empty_sequence():
    rng = np.random.default_rng(0)
    xs = _inputs(rng, 1, 2, 0, 3, 2, per_head=False, kind="rwkv")
    S0 = rng.standard_normal((1, 2, 3, 2))
    o, S = dplr.forward(*xs, scale=1.0, initial_state=S0)
    assert o.shape == (1, 2, 0, 2) and np.array_equal(S, S0)
    grads = dplr.backward(np.zeros((1, 2, 0, 2)), S0, *xs, scale=1.0, initial_state=S0)
    assert [x.shape for x in grads[:6]] == [x.shape for x in xs] and np.array_equal(grads[6], S0)


def test_no_overflow_at_minus_30_every_step():
    """A decay of exp(-30) on every step and channel: finite, and equal to the oracle."""
    rng = np.random.default_rng(7)
    q, k, v, a, b, _ = _inputs(rng, 1, 1, 70, 4, 3, per_head=False, kind="rwkv")
    for g in (np.full((1, 1, 70, 4), -30.0), np.full((1, 1, 70), -30.0)):
        o, S = dplr.forward(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), a.astype(np.float32),
                            b.astype(np.float32), g.astype(np.float32), scale=0.5, chunk=64)
        grads = dplr.backward(np.ones(o.shape, np.float32), None, *(x.astype(np.float32) for x in (q, k, v, a, b, g)),
                              scale=0.5, chunk=64)
        assert np.isfinite(o).all() and np.isfinite(S).all() and all(np.isfinite(x).all() for x in grads)
        o64, _ = dplr.forward(q, k, v, a, b, g, scale=0.5, chunk=64)
        assert _max_err([o64], [R.dplr_forward(q, k, v, a, b, g, scale=0.5)[0]]) < 1e-12


def test_chunk_is_bounded_by_T_and_default():
    assert dplr.chunk_size(None, 1000) == dplr.CHUNK
    assert dplr.chunk_size(500, 7) == 7 and dplr.chunk_size(3, 7) == 3


def test_unit_lower_inverse():
    rng = np.random.default_rng(3)
    for C in (1, 2, 15, 16, 17, 40):
        L = np.tril(rng.standard_normal((2, C, C)) * 0.3, -1)
        P = dplr_chunk.unit_lower_inverse(L)
        np.testing.assert_allclose(P @ (np.eye(C) - L), np.broadcast_to(np.eye(C), P.shape), atol=1e-12)


def test_running_product():
    from qkv.recurrent.generalized_delta.scores import running_product
    x = np.random.default_rng(1).uniform(0, 1, (2, 13, 3))
    np.testing.assert_allclose(running_product(x), np.cumprod(x, axis=-2), rtol=1e-14)
    np.testing.assert_allclose(running_product(x, reverse=True), np.cumprod(x[:, ::-1], axis=-2)[:, ::-1], rtol=1e-14)
    assert running_product(x[:, :0]).shape == (2, 0, 3)


def _loop32(q, k, v, a, b, g, do, dstate, S0, scale):
    """naive.py's step loop, forward and reverse mode, in plain float32 (the budget's
    yardstick): ``(o, S_T, dq, dk, dv, da, db, dg, dS0)``."""
    f = np.float32
    q, k, v, a, b, do = (x.astype(f) for x in (q, k, v, a, b, do))
    e = np.exp(steps.channels(g.astype(f), q.shape[-1]))
    S, before, o = S0.astype(f), [], np.empty(v.shape, f)
    for t in range(q.shape[2]):
        before.append(S)
        aS = np.einsum("bhk,bhkv->bhv", a[:, :, t], S)
        S = e[:, :, t, :, None] * S + b[:, :, t, :, None] * aS[:, :, None] + k[:, :, t, :, None] * v[:, :, t, None]
        o[:, :, t] = f(scale) * np.einsum("bhkv,bhk->bhv", S, q[:, :, t])
    S_T, dS = S, dstate.astype(f)
    dq, dk, dv, da, db, dgc = (np.zeros(x.shape, f) for x in (q, k, v, a, b, e))
    for t in reversed(range(q.shape[2])):
        dS = dS + f(scale) * q[:, :, t, :, None] * do[:, :, t, None]
        dq[:, :, t] = f(scale) * np.einsum("bhkv,bhv->bhk", S, do[:, :, t])
        S = before[t]
        bdS = np.einsum("bhk,bhkv->bhv", b[:, :, t], dS)
        da[:, :, t] = np.einsum("bhkv,bhv->bhk", S, bdS)
        db[:, :, t] = np.einsum("bhkv,bhv->bhk", dS, np.einsum("bhk,bhkv->bhv", a[:, :, t], S))
        dgc[:, :, t] = e[:, :, t] * np.einsum("bhkv,bhkv->bhk", dS, S)
        dk[:, :, t] = np.einsum("bhkv,bhv->bhk", dS, v[:, :, t])
        dv[:, :, t] = np.einsum("bhkv,bhk->bhv", dS, k[:, :, t])
        dS = e[:, :, t, :, None] * dS + a[:, :, t, :, None] * bdS[:, :, None]
    return o, S_T, dq, dk, dv, da, db, dgc if g.ndim == 4 else dgc.sum(-1), dS


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("chunk", [None, 64])
def test_float32_forward_within_budget(per_head, chunk):
    """Budget: 2x the plain float32 step recurrence's error against float64, relative to the
    largest entry (measured over seeds and chunks 16, 32, 64: 0.7-1.5x; the decay factors
    are running products of exp(g), not exponentials of differences of rounded sums)."""
    rng = np.random.default_rng(11)
    xs = _inputs(rng, 1, 2, 300, 32, 32, per_head=per_head, kind="rwkv")
    xs = (xs[0], xs[1] / np.sqrt(32)) + xs[2:]
    o_ref, S_ref = R.dplr_forward(*xs, scale=32 ** -0.5)
    o, S = dplr.forward(*(x.astype(np.float32) for x in xs), scale=32 ** -0.5, chunk=chunk)
    assert o.dtype == np.float32 and S.dtype == np.float32
    o_step, S_step = _loop32(*xs, np.zeros(o.shape), np.zeros(S.shape), np.zeros(S.shape), 32 ** -0.5)[:2]
    base = _max_err([o_step], [o_ref]) / np.abs(o_ref).max()
    assert _max_err([o], [o_ref]) / np.abs(o_ref).max() <= 2 * base
    assert _max_err([S], [S_ref]) / np.abs(S_ref).max() <= 2 * _max_err([S_step], [S_ref]) / np.abs(S_ref).max()


def _rel(got, ref) -> float:
    """max|got - ref| over max|ref| (the error budgets' measure, one array at a time)."""
    return np.abs(np.asarray(got) - ref).max(initial=0.0) / max(np.abs(ref).max(initial=0.0), 1e-300)


STEEP = [-10.0, -20.0, -30.0, "mixed -30", "mixed -1e4", "mixed -3e38"]


def _steep(rng, per_head, kind, steep, T=100, Dk=6, Dv=4):
    """``(q, k, v, a, b, g, S0, dstate, dout)``: g constant, or a quarter of the steps (a
    reset at -3e38) at the named value and the rest in [-1, 0] (all of them: "mild")."""
    q, k, v, a, b, g = _inputs(rng, 1, 2, T, Dk, Dv, per_head=per_head, kind=kind)
    if isinstance(steep, float):
        g = np.full(g.shape, steep)
    elif steep != "mild":
        g[rng.uniform(0, 1, g.shape) < 0.25] = float(steep.split()[1])
    return q, k, v, a, b, g, rng.standard_normal((1, 2, Dk, Dv)), rng.standard_normal((1, 2, Dk, Dv)), \
        rng.standard_normal((1, 2, T, Dv))


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("steep", STEEP)
def test_steep_decays_float64(per_head, steep):
    """Issue 51: the outputs, the final state and every gradient, dlog_decay included, within
    1e-10 of the largest true entry of each array, at decays of -10 to -30 every step and
    single steps far steeper. dlog_decay was a reverse running sum of O(1) terms that cancel
    down to its O(exp(g)) value: 1e-3 of it at -30 (the module docstring of backward.py)."""
    rng = np.random.default_rng(51)
    for kind, chunk in (("rwkv", None), ("generic", 16)):
        q, k, v, a, b, g, S0, dS, do = _steep(rng, per_head, kind, steep)
        kw = dict(scale=0.6, initial_state=S0)
        got = dplr.forward(q, k, v, a, b, g, chunk=chunk, **kw) + dplr.backward(do, dS, q, k, v, a, b, g, chunk=chunk, **kw)
        ref = R.dplr_forward(q, k, v, a, b, g, **kw) + R.dplr_backward(do, dS, q, k, v, a, b, g, **kw)
        for name, x, y in zip("o S dq dk dv da db dg dS0".split(), got, ref):
            assert _rel(x, y) <= 1e-10, (name, kind, _rel(x, y))


@pytest.mark.parametrize("G", [-1e8, -1e10, -1e20, -3e38])
def test_one_decay_a_head_huge_finite_steps(G):
    """Issue 51: every third step at G, the others in [-1, -0.01], one decay a head. The
    chunk's decays were differences of running sums, which lose the small steps behind a
    huge one (-1e20 + (-0.5) == -1e20): 0.94 of the outputs at -1e20. The per-channel form
    of the same decays is the control."""
    rng = np.random.default_rng(7)
    q, k, v, a, b, _ = _inputs(rng, 1, 2, 100, 8, 6, per_head=True, kind="rwkv")
    g = -rng.uniform(0.01, 1, (1, 2, 100))
    g[..., ::3] = G
    do, dS = rng.standard_normal(v.shape), rng.standard_normal((1, 2, 8, 6))
    for g_form in (g, np.repeat(g[..., None], 8, axis=-1)):
        got = dplr.forward(q, k, v, a, b, g_form, scale=0.5) + dplr.backward(do, dS, q, k, v, a, b, g_form, scale=0.5)
        ref = R.dplr_forward(q, k, v, a, b, g_form, scale=0.5) + R.dplr_backward(do, dS, q, k, v, a, b, g_form, scale=0.5)
        for name, x, y in zip("o S dq dk dv da db dg dS0".split(), got, ref):
            assert _rel(x, y) <= 1e-10, (name, g_form.ndim, _rel(x, y))


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("steep", ["mild"] + STEEP)
def test_float32_steep_within_budget(per_head, steep):
    """float32 against the float64 oracle: every output and gradient within 4x the float32
    step loop's own error (each relative to the largest true entry) plus two float32 ulps of
    that entry (the loop's error can be below one, where a ratio says nothing). Measured over
    twelve seeds: at most 2.1x beyond the floor, 5.5x without it, in cases that are the same
    before issue 51 (the old dlog_decay: up to 2e13x at -30). (With a, b of size 1/2 a channel at Dk = 16, the transitions expand
    by up to ~4 a step, and the chunked form's dq and dinitial_state reach 11x at mild decays,
    before and after issue 51 alike: the WY inverse's conditioning, not the decays.)"""
    rng = np.random.default_rng(52)
    for kind in ("rwkv", "generic"):
        q, k, v, a, b, g, S0, dS, do = _steep(rng, per_head, kind, steep, T=96, Dk=16, Dv=16)
        k = k / 4
        if kind == "generic":                       # small: |a| |b| ~ 1/4, not an expanding transition
            a, b = a / 4, b / 4
        xs = [x.astype(np.float32) for x in (q, k, v, a, b, g, S0, dS, do)]
        q, k, v, a, b, g, S0, dS, do = (x.astype(np.float64) for x in xs)
        ref = R.dplr_forward(q, k, v, a, b, g, scale=0.25, initial_state=S0) + \
            R.dplr_backward(do, dS, q, k, v, a, b, g, scale=0.25, initial_state=S0)
        base = _loop32(q, k, v, a, b, g, do, dS, S0, 0.25)
        got = dplr.forward(*xs[:6], scale=0.25, initial_state=xs[6]) + \
            dplr.backward(xs[8], xs[7], *xs[:6], scale=0.25, initial_state=xs[6])
        for name, x, y, z in zip("o S dq dk dv da db dg dS0".split(), got, base, ref):
            assert x.dtype == np.float32, name
            assert _rel(x, z) <= 4 * _rel(y, z) + 2.0 ** -22, (name, kind, _rel(x, z), _rel(y, z))


# --- the public entry points: finite differences and argument checks ----------------------------

def _numeric(loss, xs, i, eps=1e-6):
    x, num = xs[i], np.zeros_like(xs[i])
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + eps
        lp = loss(*xs)
        x[idx] = old - eps
        lm = loss(*xs)
        x[idx] = old
        num[idx] = (lp - lm) / (2 * eps)
    return num


@pytest.mark.parametrize("per_head", [False, True])
def test_public_dplr_backward_finite_differences(per_head):
    rng = np.random.default_rng(5)
    q, k, v, a, b, g = _inputs(rng, 1, 1, 7, 3, 2, per_head=per_head, kind="generic")
    S0 = rng.standard_normal((1, 1, 3, 2))
    do, dS = rng.standard_normal((1, 1, 7, 2)), rng.standard_normal((1, 1, 3, 2))
    kw = dict(scale=0.8, chunk_size=3)

    def loss(q, k, v, a, b, g, S0):
        o, S = rec.dplr(q, k, v, a, b, g, initial_state=S0, return_state=True, **kw)
        return (o * do).sum() + (S * dS).sum()

    xs = [q, k, v, a, b, g, S0]
    grads = rec.dplr_backward(do, *xs[:6], initial_state=S0, dstate=dS, **kw)
    for i, name in enumerate("q k v a b log_decay initial_state".split()):
        np.testing.assert_allclose(grads[i], _numeric(loss, xs, i), atol=1e-7, err_msg=name)
    assert rec.dplr_backward(do, *xs[:6], **kw)[6] is None


def test_public_dplr_shape_errors():
    rng = np.random.default_rng(0)
    q, k, v, a, b, g = _inputs(rng, 2, 3, 4, 5, 6, per_head=False, kind="rwkv")
    with pytest.raises(ShapeError, match=r"a must have shape \(B, H, T, Dk\) = \(2, 3, 4, 5\); got \(2, 3, 4, 6\)"):
        rec.dplr(q, k, v, np.zeros((2, 3, 4, 6)), b, g)
    with pytest.raises(ShapeError, match=r"b must have shape \(B, H, T, Dk\) = \(2, 3, 4, 5\); got \(2, 3, 4\)"):
        rec.dplr(q, k, v, a, b[..., 0], g)
    with pytest.raises(ShapeError, match=r"b must have shape .* got \(2, 3, 5, 5\)"):
        rec.dplr_backward(np.zeros(v.shape), q, k, v, a, np.zeros((2, 3, 5, 5)), g)
    with pytest.raises(ShapeError, match="log_decay must have shape"):
        rec.dplr(q, k, v, a, b, g[..., :2])
    with pytest.raises(ShapeError, match="log_decay must be finite and <= 0"):
        rec.dplr(q, k, v, a, b, -g)


def test_same_inputs_same_bits():
    rng = np.random.default_rng(2)
    xs = [x.astype(np.float32) for x in _inputs(rng, 1, 2, 50, 8, 8, per_head=False, kind="rwkv")]
    first = rec.dplr(*xs)
    rec.dplr(*[x[:, :, :17] for x in xs], chunk_size=5)
    assert np.array_equal(first, rec.dplr(*xs))


# --- flash-linear-attention's dplr_recurrence -----------------------------------------------------

@pytest.mark.parametrize("per_head", [False, True])
def test_against_fla_dplr_recurrence(per_head):
    """fla's reference computes in float32 (it casts q, k, v, b, g with .float()): our float64
    result is compared at a float32 tolerance; its gradients come from torch autograd."""
    torch = pytest.importorskip("torch")
    fla = naive("generalized_delta_rule/dplr")
    rng = np.random.default_rng(9)
    xs = _inputs(rng, 2, 2, 37, 8, 6, per_head=per_head, kind="rwkv")
    S0 = rng.standard_normal((2, 2, 8, 6))
    do = rng.standard_normal((2, 2, 37, 6))
    o, S = rec.dplr(*xs, initial_state=S0, return_state=True, chunk_size=16)
    ts = [torch.tensor(x, dtype=torch.float32, requires_grad=True) for x in (*xs, S0)]
    gk = ts[5][..., None].expand(*ts[0].shape) if per_head else ts[5]
    o_fla, S_fla = fla.dplr_recurrence(ts[0], ts[1], ts[2], ts[3], ts[4], gk, initial_state=ts[6])
    (o_fla * torch.tensor(do, dtype=torch.float32)).sum().backward()

    def close(ours, theirs, what):
        theirs = theirs.detach().numpy().astype(np.float64)
        assert _max_err([ours], [theirs]) <= 2e-5 * max(1.0, np.abs(theirs).max()), what

    close(o, o_fla, "o")
    close(S, S_fla, "S")
    grads = rec.dplr_backward(do, *xs, initial_state=S0, chunk_size=16)
    for name, ours, t in zip("q k v a b log_decay initial_state".split(), grads, ts):
        close(ours, t.grad, name)


@pytest.mark.parametrize("per_head", [False, True])
def test_float32_gradients_within_budget(per_head):
    """float32 gradients against float64 within 8x the plain float32 step recurrence's
    (fla's dplr_recurrence under torch autograd). Measured over six seeds at chunks 32 and
    64: 1.6-3.4x, dlog_decay of one decay a head up to 3.8x (it was 5.8x, 11.7x at chunk 64,
    while dg was a running sum of terms that cancel; now every term crosses its step)."""
    torch = pytest.importorskip("torch")
    fla = naive("generalized_delta_rule/dplr")
    rng = np.random.default_rng(4)
    xs = _inputs(rng, 1, 2, 128, 32, 32, per_head=per_head, kind="rwkv")
    xs = (xs[0], xs[1] / np.sqrt(32)) + xs[2:]
    do = rng.standard_normal((1, 2, 128, 32))
    refs = R.dplr_backward(do, None, *xs, scale=32 ** -0.5)
    ours = dplr.backward(do.astype(np.float32), None, *(x.astype(np.float32) for x in xs), scale=32 ** -0.5)
    ts = [torch.tensor(x, dtype=torch.float32, requires_grad=True) for x in xs]
    gk = ts[5][..., None].expand(*ts[0].shape) if per_head else ts[5]
    o_fla, _ = fla.dplr_recurrence(ts[0], ts[1], ts[2], ts[3], ts[4], gk)
    (o_fla * torch.tensor(do, dtype=torch.float32)).sum().backward()
    for name, got, ref, t in zip("q k v a b g".split(), ours, refs, ts):
        assert got.dtype == np.float32
        base = _max_err([t.grad.numpy()], [ref])
        assert _max_err([got], [ref]) <= 8 * base, name
