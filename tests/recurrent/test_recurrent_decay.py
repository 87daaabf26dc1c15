"""The chunked decay recurrence (qkv.recurrent.decay.chunk) against the float64 step oracle
(qkv.recurrent.steps), finite differences, float32 step loops, flash-linear-attention's
naive recurrences, and the public API's checks."""
import tracemalloc

import numpy as np
import pytest

import qkv.recurrent as rec
from qkv import threads
from qkv.errors import ShapeError
from qkv.recurrent.decay import chunk as decay, naive as R

DK, DV = 6, 5


def problem(rng, T, per_channel, *, B=1, H=2, dtype=np.float64, strength=30.0):
    """q, k, v, g, S0, dout, dstate; g in [-strength, 0], many small, some near -strength."""
    q, k = (rng.standard_normal((B, H, T, DK)) for _ in range(2))
    v, do = (rng.standard_normal((B, H, T, DV)) for _ in range(2))
    g = -strength * rng.random((B, H, T, DK) if per_channel else (B, H, T)) ** 3
    S0, dS = (rng.standard_normal((B, H, DK, DV)) for _ in range(2))
    return [x.astype(dtype) for x in (q, k, v, g, S0, do, dS)]


def close(got, want, tol):
    scale = max(1.0, float(np.abs(want).max()))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale)


@pytest.mark.parametrize("per_channel", [False, True], ids=["head", "channel"])
@pytest.mark.parametrize("T", [1, 5, 64, 100, 257])
@pytest.mark.parametrize("chunk", [1, 3, 16, 40, 64, None])
@pytest.mark.parametrize("strength", [0.1, 30.0], ids=["weak", "strong"])
def test_chunked_equals_the_step_oracle_in_float64(per_channel, T, chunk, strength):
    """Weak decays: a head's chunks take the rank-one factors; strong: the (C, C) exps."""
    rng = np.random.default_rng(T * 7 + (chunk or 0))
    q, k, v, g, S0, do, dS = problem(rng, T, per_channel, strength=strength)
    for state, dstate in ((S0, dS), (None, None), (None, dS), (S0, None)):
        o, S_T = decay.forward(q, k, v, g, scale=0.6, initial_state=state, chunk=chunk)
        o_ref, S_ref = R.decay_forward(q, k, v, g, scale=0.6, initial_state=state)
        close(o, o_ref, 1e-10)
        close(S_T, S_ref, 1e-10)
        got = decay.backward(do, dstate, q, k, v, g, scale=0.6, initial_state=state, chunk=chunk)
        want = R.decay_backward(do, dstate, q, k, v, g, scale=0.6, initial_state=state)
        for name, a, b in zip(["dq", "dk", "dv", "dg", "dS0"], got, want):
            if state is None and name == "dS0":
                assert a is None
            else:
                close(a, b, 1e-10)


@pytest.mark.parametrize("per_channel", [False, True], ids=["head", "channel"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_long_sequence_in_segments_gives_the_bits_of_one_pass(monkeypatch, per_channel, dtype):
    """The forward works a long sequence segment after segment (SEGMENT_ROWS, the state passed
    on); here slabs of 32 rows and segments of 64 (chunks of 8 and 16) against one pass, bit
    for bit, with an initial state, a last segment cut short, strong decays, several heads."""
    rng = np.random.default_rng(11)
    q, k, v, g, S0, _, _ = problem(rng, 300, per_channel, B=2, H=3, dtype=dtype, strength=30.0)
    monkeypatch.setattr(decay, "SLAB_ROWS", 32)
    for chunk in (8, 16):
        whole = decay.forward(q, k, v, g, scale=0.5, initial_state=S0, chunk=chunk)
        with monkeypatch.context() as m:
            m.setattr(decay, "SEGMENT_ROWS", 64)
            assert len(decay._segments(300, chunk)) > 2
            parts = decay.forward(q, k, v, g, scale=0.5, initial_state=S0, chunk=chunk)
        for a, b in zip(parts, whole):
            np.testing.assert_array_equal(a, b)
    if dtype == np.float64:
        o_ref, S_ref = R.decay_forward(q, k, v, g, scale=0.5, initial_state=S0)
        close(parts[0], o_ref, 1e-10)
        close(parts[1], S_ref, 1e-10)


@pytest.mark.parametrize("per_channel", [False, True], ids=["head", "channel"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_broadcast_and_strided_inputs_give_the_bits_of_their_copies(monkeypatch, per_channel, dtype):
    """q and k broadcast over the heads (Mamba-2's B and C, one group's for every head: read
    where they lie, never copied whole) and v a transposed view, through the public API: the
    bits of the same numbers laid out C-ordered, in units of two heads cut into segments;
    with a NaN in the broadcast k too (found there: the stepwise path, NaN where the copy has it)."""
    rng = np.random.default_rng(12)
    B, H, T = 2, 3, 300
    _, _, _, g, S0, _, _ = problem(rng, T, per_channel, B=B, H=H, strength=30.0)
    q1, k1 = ((30 * rng.standard_normal((B, 1, T, DK))).astype(dtype) for _ in range(2))
    v = rng.standard_normal((B, T, H, DV)).astype(dtype).transpose(0, 2, 1, 3)
    monkeypatch.setattr(decay, "SLAB_ROWS", 32)
    monkeypatch.setattr(decay, "SEGMENT_ROWS", 64)
    monkeypatch.setattr(decay, "UNIT_ROWS", 2 * T)
    assert len(decay._units(B * H, T)) == 3 and len(decay._segments(T, 16)) > 2
    for nan in (False, True):
        if nan:
            k1[1, 0, 40, 2] = np.nan
        q, k = (np.broadcast_to(x, (B, H, T, DK)) for x in (q1, k1))
        assert q.strides[1] == 0 and not v.flags.c_contiguous
        got = rec.decay_attention(q, k, v, g, scale=0.5, initial_state=S0, return_state=True, chunk_size=16)
        want = rec.decay_attention(*map(np.ascontiguousarray, (q, k, v)), g, scale=0.5, initial_state=S0,
                                   return_state=True, chunk_size=16)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and np.isnan(a).any() == nan
            np.testing.assert_array_equal(a, b)


def test_a_broadcast_q_and_k_are_not_copied_whole():
    """Peak traced memory (NumPy reports its buffers to tracemalloc) of a forward whose q and k
    are one array broadcast over 16 heads: the output and a few rows more. Copied whole, each
    would add the output's size (3x: measured before the units read them in place)."""
    rng = np.random.default_rng(13)
    B, H, T, D = 1, 16, 4096, 32
    q, k = (np.broadcast_to(rng.standard_normal((B, 1, T, D)).astype(np.float32), (B, H, T, D)) for _ in range(2))
    v = rng.standard_normal((B, H, T, D)).astype(np.float32)
    g = -rng.random((B, H, T)).astype(np.float32)
    rec.decay_attention(q, k, v, g, scale=1.0)          # the threads' work arrays exist before the count
    tracemalloc.start()
    try:
        o = rec.decay_attention(q, k, v, g, scale=1.0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * o.nbytes, peak / o.nbytes


@pytest.mark.parametrize("per_channel", [False, True], ids=["head", "channel"])
def test_gradients_against_finite_differences_through_the_public_api(per_channel):
    rng = np.random.default_rng(5)
    q, k, v, g, S0, do, dS = problem(rng, 7, per_channel, strength=2.0)
    kw = dict(scale=0.8, chunk_size=3)

    def loss(q, k, v, g, S0):
        o, S = rec.decay_attention(q, k, v, g, initial_state=S0, return_state=True, **kw)
        return (o * do).sum() + (S * dS).sum()

    grads = rec.decay_attention_backward(do, q, k, v, g, initial_state=S0, dstate=dS, **kw)
    xs = [q, k, v, g, S0]
    for i, (x, grad) in enumerate(zip(xs, grads)):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + 1e-6
            up = loss(*xs)
            x[idx] = old - 1e-6
            down = loss(*xs)
            x[idx] = old
            num[idx] = (up - down) / 2e-6
        np.testing.assert_allclose(grad, num, atol=1e-6, err_msg=f"input {i}")


# --- float32: against plain float32 step loops, relative to their own error -----------------

def step32(q, k, v, g, scale):
    """The recurrence stepped in float32: ``(o, S_T)``, and the gradients for ``do``."""
    a = np.exp(g if g.ndim == 4 else np.broadcast_to(g[..., None], q.shape)).astype(np.float32)
    S = np.zeros(q.shape[:2] + (DK, DV), np.float32)
    o = np.empty(v.shape, np.float32)
    for t in range(q.shape[2]):
        S = a[:, :, t, :, None] * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        o[:, :, t] = np.float32(scale) * np.einsum("bhkv,bhk->bhv", S, q[:, :, t])
    return o, S


def step32_backward(do, q, k, v, g, scale):
    """dq, dk, dv, dg of ``(o * do).sum()`` through the float32 step loop (states recomputed)."""
    T = q.shape[2]
    a = np.exp(g if g.ndim == 4 else np.broadcast_to(g[..., None], q.shape)).astype(np.float32)
    states, S = [], np.zeros(q.shape[:2] + (DK, DV), np.float32)
    for t in range(T):
        states.append(S)
        S = a[:, :, t, :, None] * S + k[:, :, t, :, None] * v[:, :, t, None, :]
    dq, dk, dv, dgc = (np.zeros(x.shape, np.float32) for x in (q, k, v, a))
    dS = np.zeros_like(S)
    s = np.float32(scale)
    for t in reversed(range(T)):
        dS = dS + s * q[:, :, t, :, None] * do[:, :, t, None, :]
        dq[:, :, t] = s * np.einsum("bhkv,bhv->bhk", S, do[:, :, t])
        dk[:, :, t] = np.einsum("bhkv,bhv->bhk", dS, v[:, :, t])
        dv[:, :, t] = np.einsum("bhkv,bhk->bhv", dS, k[:, :, t])
        dgc[:, :, t] = a[:, :, t] * np.einsum("bhkv,bhkv->bhk", dS, states[t])
        S = states[t]
        dS = a[:, :, t, :, None] * dS
    return dq, dk, dv, (dgc if g.ndim == 4 else dgc.sum(-1))


def rel_err(x, ref):
    return float(np.abs(x.astype(np.float64) - ref).max() / np.abs(ref).max())


FLOAT32_BUDGET = 2.0   # chunked float32 error <= 2 x the float32 step loop's own error (measured <= 1.8, seeds 11-13)


@pytest.mark.parametrize("per_channel", [False, True], ids=["head", "channel"])
@pytest.mark.parametrize("strength", [0.1, 30.0])
def test_float32_within_a_budget_of_the_float32_step_loop(per_channel, strength):
    rng = np.random.default_rng(11)
    q, k, v, g, _, do, _ = problem(rng, 300, per_channel, B=1, H=2, strength=strength)
    o64, S64 = R.decay_forward(q, k, v, g, scale=0.5)
    grads64 = R.decay_backward(do, None, q, k, v, g, scale=0.5)[:4]
    x32 = [x.astype(np.float32) for x in (q, k, v, g, do)]
    o_step, S_step = step32(*x32[:4], 0.5)
    grads_step = step32_backward(x32[4], *x32[:4], 0.5)
    o, S = rec.decay_attention(*x32[:4], scale=0.5, return_state=True)
    grads = rec.decay_attention_backward(x32[4], *x32[:4], scale=0.5)[:4]
    assert o.dtype == np.float32 and all(x.dtype == np.float32 for x in grads)
    floor = 2 * np.finfo(np.float32).eps      # a step loop can be exact where the sums are short
    for got, step, ref in [(o, o_step, o64), (S, S_step, S64)] + list(zip(grads, grads_step, grads64)):
        assert rel_err(got, ref) <= FLOAT32_BUDGET * max(rel_err(step, ref), floor)


def test_no_nan_for_large_magnitudes_and_extreme_decays():
    rng = np.random.default_rng(3)
    T = 200
    q, k, v, do = (1e3 * rng.standard_normal((1, 2, T, DK)).astype(np.float32) for _ in range(4))
    for g in (np.full((1, 2, T, DK), -30.0), np.zeros((1, 2, T, DK)), np.full((1, 2, T), -30.0),
              -1e30 * rng.random((1, 2, T, DK)), np.full((1, 2, T), -np.finfo(np.float64).max),
              np.where(rng.random((1, 2, T, DK)) < 0.5, -30.0, 0.0)):
        for dtype in (np.float32, np.float64):
            args = [x.astype(dtype) for x in (q, k, v)] + [np.maximum(g, np.finfo(dtype).min).astype(dtype)]
            o, S = rec.decay_attention(*args, return_state=True, chunk_size=64)
            grads = rec.decay_attention_backward(do.astype(dtype), *args, dstate=S, chunk_size=64)
            for x in (o, S) + tuple(grads[:4]):
                assert np.isfinite(x).all()


def test_float32_head_decay_factors_are_never_subnormal():
    """Steep head decays (steps near -20, Mamba-2 heads with a large ``A dt``) once left the
    chunk's factors ``exp(G)``, ``exp(Γ - G)`` and the in-chunk ``D`` subnormal at some rows,
    and the products reading them took Intel's slow path (3.3x the forward's time): in float32
    a factor below 2^-60 is 0, none is subnormal, and the outputs keep float32's budget of
    float64. float64's factors are as they were."""
    from qkv.recurrent.decay import intra as decay_intra
    rng = np.random.default_rng(21)
    G = np.cumsum(-rng.uniform(0, 40, (2, 3, 64, 1)), axis=2)                # past exp(-87) and far below
    tiny = np.finfo(np.float32).tiny
    for x64 in (G, G[:, :, -1:] - G, np.where(np.tri(64, dtype=bool)[:, :, None], G[:, :, :, None] - G[:, :, None], -np.inf)):
        got = decay_intra.decayed(x64, np.float32)
        assert got.dtype == np.float32 and not np.any((got > 0) & (got < tiny))
        want = np.exp(x64)
        size = np.where(np.isfinite(x64), np.abs(x64), 0)              # NumPy's float32 exp: |x| ulps of x
        assert np.all(np.where(want < 2.0 ** -60, got == 0, np.abs(got - want) <= 2e-7 * want * (1 + size)))
        assert np.array_equal(decay_intra.decayed(x64, np.float64), want)
    q, k, v, g, S0, do, _ = problem(rng, 300, False, B=1, H=2, strength=40.0)
    o64 = R.decay_forward(q, k, v, g, scale=0.5)[0]
    x32 = [x.astype(np.float32) for x in (q, k, v, g)]
    o_step = step32(*x32, 0.5)[0]
    o = rec.decay_attention(*x32, scale=0.5)
    assert rel_err(o, o64) <= FLOAT32_BUDGET * max(rel_err(o_step, o64), 2 * np.finfo(np.float32).eps)


def test_a_steep_chunks_mask_has_numpys_bits_compiled(monkeypatch):
    """A steep chunk's ``(C, C)`` factor in float32: the compiled argument (intra_compiled.lower_mask) and
    NumPy's passes give the same bits, the differences placed at the flush (float32's neighbours of
    ``FLUSH_LOG``, compared in float32 as NumPy compares), a NaN kept, G a strided slice, C from 1 to 64."""
    from qkv import jit
    from qkv.recurrent.decay import intra as decay_intra
    if jit.load(jit.DECAY_INTRA) is None:
        pytest.skip("qkv's compiled kernels are off here (QKV_JIT=0 or no numba)")
    rng = np.random.default_rng(8)
    edge = np.float64(np.float32(decay_intra.FLUSH_LOG))
    near = sorted([np.nextafter(edge, -np.inf), edge, np.nextafter(edge, 0), decay_intra.FLUSH_LOG, edge / 2],
                  reverse=True)
    for C in (1, 2, 7, 32, 64):
        G = np.cumsum(-rng.uniform(0, 3, (3, 5, C, 2)), axis=2)[..., :1]   # a strided (n, M, C, 1)
        if C > 2:                                                       # G_i - G_0 at the flush, G falling
            steps = np.concatenate([near, near[-1] - 1e4 - np.cumsum(rng.uniform(0, 3, C))])[:C - 1]
            G[0, 1, 1:, 0] = G[0, 1, 0, 0] + steps
            G[1, 2, C // 2, 0] = np.nan
        want = decay_intra._lower(G.copy(), np.float32).copy()
        got = decay_intra._lower(G, np.float32).copy()
        monkeypatch.setattr(jit, "load", lambda name: None)
        numpy_passes = decay_intra._lower(G, np.float32).copy()
        monkeypatch.undo()
        assert np.array_equal(got.view(np.int32), numpy_passes.view(np.int32)), C
        assert np.array_equal(want.view(np.int32), numpy_passes.view(np.int32)), C
        assert np.all(got[..., np.triu_indices(C, 1)[0], np.triu_indices(C, 1)[1]] == 0)


@pytest.mark.parametrize("per_channel", [True, False], ids=["channel", "head"])
def test_the_bits_do_not_depend_on_the_thread_count(per_channel):
    """A decay a head takes the compiled chunk loop in float32 (with the fast extra): its units
    on two threads call BLAS from two threads at once (T = 2048: three units of two heads)."""
    rng = np.random.default_rng(4)
    q, k, v, g, S0, do, dS = problem(rng, 300 if per_channel else 2048, per_channel, B=2, H=3, dtype=np.float32)
    runs = []
    for n in (1, 2):
        with threads.kernel_threads(n):
            runs.append(list(decay.forward(q, k, v, g, scale=0.5, initial_state=S0))
                        + list(decay.backward(do, dS, q, k, v, g, scale=0.5, initial_state=S0)))
    for a, b in zip(*runs):
        assert np.array_equal(a, b)


# --- flash-linear-attention's naive recurrences (layout (B, T, H, D)) -----------------------

@pytest.mark.parametrize("per_channel", [False, True], ids=["simple_gla", "gla"])
def test_matches_flash_linear_attention_naive_recurrences(per_channel):
    from fla_reference import naive
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    q, k, v, g, S0, _, _ = problem(rng, 50, per_channel, B=2, H=3, strength=3.0)
    bthd = lambda x: torch.tensor(np.swapaxes(x, 1, 2).astype(np.float32))  # noqa: E731 (B,H,T,·) -> (B,T,H,·)
    S0t = torch.tensor(S0.astype(np.float32))
    if per_channel:   # naive_recurrent_gla: scale Dk^-0.5 always
        o_fla, S_fla = naive("gla").naive_recurrent_gla(bthd(q), bthd(k), bthd(v), bthd(g), initial_state=S0t,
                                                        output_final_state=True)
        scale = DK ** -0.5
    else:
        scale = 0.7
        o_fla, S_fla = naive("simple_gla").naive_recurrent_simple_gla(
            bthd(q), bthd(k), bthd(v), torch.tensor(np.swapaxes(g, 1, 2).astype(np.float32)), scale=scale,
            initial_state=S0t, output_final_state=True)
    o, S = rec.decay_attention(q, k, v, g, scale=scale, initial_state=S0, return_state=True)
    close(np.swapaxes(o_fla.numpy(), 1, 2), o, 1e-5)
    close(S_fla.numpy(), S, 1e-5)


# --- the public API's checks name the argument ----------------------------------------------

@pytest.mark.parametrize("bad,name", [
    (dict(log_decay=np.zeros((1, 2, 4, DK + 1))), "log_decay"),
    (dict(log_decay=np.zeros((1, 2, 5))), "log_decay"),
    (dict(log_decay=np.full((1, 2, 4), 0.5)), "log_decay"),
    (dict(log_decay=np.full((1, 2, 4), np.nan)), "log_decay"),
    (dict(k=np.zeros((1, 2, 4, DK + 1))), "k"),
    (dict(v=np.zeros((1, 2, 3, DV))), "v"),
    (dict(q=np.zeros((2, 4, DK))), "q"),
    (dict(initial_state=np.zeros((1, 2, DK, DV + 1))), "initial_state"),
    (dict(chunk_size=0), "chunk_size"),
])
def test_bad_input_names_the_argument(bad, name):
    args = dict(q=np.zeros((1, 2, 4, DK)), k=np.zeros((1, 2, 4, DK)), v=np.zeros((1, 2, 4, DV)),
                log_decay=np.zeros((1, 2, 4)))
    args.update(bad)
    with pytest.raises(ShapeError, match=name):
        rec.decay_attention(**args)
    with pytest.raises(ShapeError, match=name):
        rec.decay_attention_backward(np.zeros((1, 2, 4, DV)), **args)


@pytest.mark.parametrize("bad,name", [(dict(dstate=np.zeros((1, 2, DK + 1, DV))), "dstate"),
                                      (dict(dout=np.zeros((1, 2, 4, DV + 1))), "dout")])
def test_bad_gradient_inputs_name_the_argument(bad, name):
    args = dict(dout=np.zeros((1, 2, 4, DV)), q=np.zeros((1, 2, 4, DK)), k=np.zeros((1, 2, 4, DK)),
                v=np.zeros((1, 2, 4, DV)), log_decay=np.zeros((1, 2, 4)))
    args.update(bad)
    with pytest.raises(ShapeError, match=name):
        rec.decay_attention_backward(**args)


# --- steep decays: every gradient, dlog_decay included, against the largest true entry ------

def steep_g(rng, shape, steep):
    """Constant ``steep`` a step, or (``"resets"``) steps in [-1, 0] with a fifth at -30, -1e4
    or -3e38 (a reset: exp(g) is 0)."""
    if steep != "resets":
        return np.full(shape, float(steep))
    g = -rng.random(shape)
    hit = rng.random(shape) < 0.2
    g[hit] = rng.choice([-30.0, -1e4, -3e38], size=int(hit.sum()))
    return g


def rel_to_top(x, ref):
    return float(np.abs(np.asarray(x, np.float64) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("per_channel", [False, True], ids=["head", "channel"])
@pytest.mark.parametrize("steep", [-10, -20, -30, "resets"])
@pytest.mark.parametrize("chunk", [None, 16])
def test_steep_decays_every_gradient_to_1e_10_in_float64(per_channel, steep, chunk):
    """At g = -30 a step the true dg is about exp(-30) of the others: a chunked backward that
    writes it as differences of undecayed terms (rowsum - colsum, a reversed sum) kept 3
    digits of it in float64 (2.7e-3, qkv.recurrent.crossing); the budget is the docs' 1e-10
    of each array's largest true entry, for every output and gradient."""
    rng = np.random.default_rng(5)
    q, k, v, _, S0, do, dS = problem(rng, 100, per_channel)
    g = steep_g(rng, (1, 2, 100, DK) if per_channel else (1, 2, 100), steep)
    o, S = rec.decay_attention(q, k, v, g, scale=0.5, initial_state=S0, return_state=True, chunk_size=chunk)
    o_ref, S_ref = R.decay_forward(q, k, v, g, scale=0.5, initial_state=S0)
    got = rec.decay_attention_backward(do, q, k, v, g, scale=0.5, initial_state=S0, dstate=dS, chunk_size=chunk)
    want = R.decay_backward(do, dS, q, k, v, g, scale=0.5, initial_state=S0)
    for name, a, b in zip(["o", "S_T", "dq", "dk", "dv", "dg", "dS0"], (o, S) + tuple(got), (o_ref, S_ref) + tuple(want)):
        assert rel_to_top(a, b) <= 1e-10, name


@pytest.mark.parametrize("per_channel", [False, True], ids=["head", "channel"])
@pytest.mark.parametrize("steep", [-10, -20, -30, "resets"])
def test_steep_decays_float32_within_a_budget_of_the_float32_step_loop(per_channel, steep):
    """float32 at steep decays: each gradient's error (relative to its largest true entry) at
    most twice the plain float32 step loop's (was 1e6 for dg at g = -30)."""
    rng = np.random.default_rng(6)
    q, k, v, _, _, do, _ = problem(rng, 120, per_channel)
    g = steep_g(rng, (1, 2, 120, DK) if per_channel else (1, 2, 120), steep)
    want = R.decay_backward(do, None, q, k, v, g, scale=0.5)[:4]
    x32 = [x.astype(np.float32) for x in (q, k, v, np.maximum(g, np.finfo(np.float32).min), do)]
    steps = step32_backward(x32[4], *x32[:4], 0.5)
    got = rec.decay_attention_backward(x32[4], *x32[:4], scale=0.5)[:4]
    floor = 2 * np.finfo(np.float32).eps
    for name, a, s, w in zip(["dq", "dk", "dv", "dg"], got, steps, want):
        assert rel_to_top(a, w) <= FLOAT32_BUDGET * max(rel_to_top(s, w), floor), name


@pytest.mark.parametrize("per_channel", [False, True], ids=["head", "channel"])
def test_a_reset_step_gives_dg_of_zero_there(per_channel):
    """exp(-1e4) is 0 in every dtype: the step's decay gradient a_t · Σ dS ∘ S is 0. With one
    decay a head every term of dg carries it, so dg is exactly 0; with a decay a channel the
    pairs inside one sub-block of rows may leave their rounding (about eps of the largest
    gradient), never the terms of undecayed size that cancelled before."""
    rng = np.random.default_rng(7)
    q, k, v, _, S0, do, dS = problem(rng, 70, per_channel)
    g = -rng.random((1, 2, 70, DK) if per_channel else (1, 2, 70))
    g[:, :, [5, 31, 32, 63]] = -1e4
    for dtype in (np.float64, np.float32):
        args = [x.astype(dtype) for x in (q, k, v, g)]
        dg = rec.decay_attention_backward(do.astype(dtype), *args, initial_state=S0.astype(dtype),
                                          dstate=dS.astype(dtype))[3]
        at_resets = np.abs(dg[:, :, [5, 31, 32, 63]]).max()
        assert at_resets <= (8 * np.finfo(dtype).eps * np.abs(dg).max() if per_channel else 0)


def test_a_units_heads_broadcast_from_one_head_are_gathered_once():
    """units.rows: heads of one batch row that read one C-ordered head (stride 0: shared_once's copy) take
    it in place, broadcast over the unit (the same numbers); a unit across two batch rows, heads that
    are not one broadcast head, or one whose rows are strided, gather each head."""
    from qkv.recurrent import units

    base = np.arange(2 * 1 * 9 * 3, dtype=np.float32).reshape(2, 1, 9, 3)
    x = np.broadcast_to(base, (2, 4, 9, 3))
    strided = np.broadcast_to(np.ascontiguousarray(base.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2), (2, 4, 9, 3))
    own = np.ascontiguousarray(np.broadcast_to(base, (2, 4, 9, 3)).transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    made = []

    def work(shape, dt):
        made.append(shape)
        return np.empty(shape, dt)
    for arr, a, b, shape in ((x, 1, 3, None), (x, 5, 8, None), (strided, 1, 3, (2, 5, 3)), (strided, 5, 8, (3, 5, 3)),
                             (x, 3, 5, (2, 5, 3)), (own, 1, 3, (2, 5, 3))):
        made.clear()
        got = units.rows(arr, a, b, 2, 7, work)
        assert made == ([] if shape is None else [shape])
        want = np.stack([arr[i // 4, i % 4, 2:7] for i in range(a, b)])
        np.testing.assert_array_equal(got, want)
        assert (got.strides[0] == 0) == (shape is None)
        assert np.shares_memory(got, arr) == (shape is None)


def test_a_call_copies_a_head_broadcast_over_its_heads_once(monkeypatch):
    """The decay forward copies a q, k or v broadcast over its heads once a call, in memory of its own
    (units.shared_once), and every unit of one batch row reads that copy: no unit gathers (a unit across
    batch rows gathers each head, as before). q and k broadcast from one array
    stay two operands, so the compiled forward takes them as it took the units' gathers: the bits of q
    and k passed as two C-ordered arrays, Mamba-2's strided rows of one projection and the same array
    alike, one and two threads."""
    from qkv.recurrent import units

    rng = np.random.default_rng(17)
    B, H, T, D = 1, 6, 200, 16
    proj = rng.standard_normal((B, T, 3 * D + 5)).astype(np.float32)          # one projection's rows
    C_, B_ = (np.broadcast_to(proj[:, None, :, o:o + D], (B, H, T, D)) for o in (5, 5 + D))
    dense = np.broadcast_to(np.ascontiguousarray(proj[:, None, :, 5:5 + D]), (B, H, T, D))   # C-ordered head
    v = rng.standard_normal((B, H, T, D)).astype(np.float32)
    g = (-rng.uniform(0, 3, (B, H, T))).astype(np.float32)
    gathers, real = [], units.rows
    monkeypatch.setattr(units, "rows", lambda x, a, b, t0, t1, work: real(x, a, b, t0, t1,
                                                                          lambda *s: gathers.append(s) or work(*s)))
    for threads_ in (1, 2):
        threads.set_num_threads(threads_)
        for q, k in ((C_, B_), (C_, C_), (dense, dense)):
            gathers.clear()
            got = rec.decay_attention(q, k, v, g, scale=1.0, return_state=True)
            assert gathers == []
            want = rec.decay_attention(np.ascontiguousarray(q), np.ascontiguousarray(k), v, g, scale=1.0,
                                       return_state=True)
            for a, b in zip(got, want):
                assert np.array_equal(a, b)
    threads.set_num_threads(None)
