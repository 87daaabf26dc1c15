"""The chunked delta rule (qkv.recurrent.delta.chunk, delta_backward) against the float64 step oracle
(qkv.recurrent.steps), finite differences, a float32 step loop, and the outside
references: flash-linear-attention's naive recurrences and transformers' Qwen3-Next
functions (torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule)."""
import functools

import numpy as np
import pytest

import qkv.recurrent as rec
from qkv.recurrent.delta import chunk as delta, naive as recurrence

B, H, DK, DV = 1, 2, 6, 5
CHUNKS = [1, 3, 16, 64, None]


def _inputs(T, regime, state, seed=0, dims=(B, H, DK, DV), dtype=np.float64):
    """``(q, k, v, beta, g, S0, do, dS)``; ``regime`` picks the keys, betas and decays."""
    b, h, dk, dv = dims
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((b, h, T, dk)), rng.standard_normal((b, h, T, dk))
    v, do = rng.standard_normal((b, h, T, dv)), rng.standard_normal((b, h, T, dv))
    if regime == "raw":                                   # not normalised: |k|² from about 0.3 to 1.7
        k *= rng.uniform(0.5, 1.3, (b, h, T, 1)) / np.linalg.norm(k, axis=-1, keepdims=True)
    else:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = rng.uniform(0, 2 if regime == "strong" else 1, (b, h, T))
    g = -rng.uniform(0, 1, (b, h, T))
    if regime == "strong":                                # some steps forget almost everything
        g[rng.uniform(size=g.shape) < 0.2] = -30.0
    S0, dS = (rng.standard_normal((b, h, dk, dv)) if state else None for _ in range(2))
    return [None if x is None else x.astype(dtype) for x in (q, k, v, beta, g, S0, do, dS)]


def _close(got, want, tol, what):
    scale = max(1.0, float(np.abs(want).max(initial=0)))
    err = float(np.abs(got - want).max(initial=0)) / scale
    assert err <= tol, f"{what}: max error {err:.2e} (relative to {scale:.2g}) > {tol:.0e}"


@functools.lru_cache(maxsize=None)
def _oracle(T, gated, regime, state):
    q, k, v, beta, g, S0, do, dS = _inputs(T, regime, state)
    g = g if gated else None
    o, S = recurrence.delta_forward(q, k, v, beta, g, scale=0.7, initial_state=S0)
    grads = recurrence.delta_backward(do, dS, q, k, v, beta, g, scale=0.7, initial_state=S0)
    return o, S, grads


@pytest.mark.parametrize("T", [1, 5, 64, 100, 257])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("regime", ["unit", "strong", "raw"])
@pytest.mark.parametrize("state", [False, True])
def test_chunked_equals_the_step_oracle(T, gated, regime, state):
    """float64, every chunk size: outputs, final state and all six gradients to 1e-10."""
    q, k, v, beta, g, S0, do, dS = _inputs(T, regime, state)
    g = g if gated else None
    o_ref, S_ref, grads_ref = _oracle(T, gated, regime, state)
    for chunk in CHUNKS:
        o, S = delta.forward(q, k, v, beta, g, scale=0.7, initial_state=S0, chunk=chunk)
        _close(o, o_ref, 1e-10, f"o, chunk {chunk}")
        _close(S, S_ref, 1e-10, f"S_T, chunk {chunk}")
        grads = delta.backward(do, dS, q, k, v, beta, g, scale=0.7, initial_state=S0, chunk=chunk)
        for name, got, want in zip(["dq", "dk", "dv", "dbeta", "dg", "dS0"], grads, grads_ref):
            if (name == "dg" and not gated) or (name == "dS0" and not state):
                assert got is None, name
                continue
            _close(got, want, 1e-10, f"{name}, chunk {chunk}")


@pytest.mark.parametrize("given", ["initial_state", "dstate"])
def test_initial_state_and_dstate_apart(given):
    """One of the two without the other (zeros stand for the missing one)."""
    q, k, v, beta, g, S0, do, dS = _inputs(100, "unit", True, seed=2)
    S0, dS = (S0, None) if given == "initial_state" else (None, dS)
    o_ref, S_ref = recurrence.delta_forward(q, k, v, beta, g, scale=0.7, initial_state=S0)
    want = recurrence.delta_backward(do, dS, q, k, v, beta, g, scale=0.7, initial_state=S0)
    for chunk in CHUNKS:
        o, S = delta.forward(q, k, v, beta, g, scale=0.7, initial_state=S0, chunk=chunk)
        _close(o, o_ref, 1e-10, "o")
        _close(S, S_ref, 1e-10, "S_T")
        got = delta.backward(do, dS, q, k, v, beta, g, scale=0.7, initial_state=S0, chunk=chunk)
        assert (got[-1] is None) == (S0 is None)
        for a, b in zip(got[:5], want[:5]):
            _close(a, b, 1e-10, f"chunk {chunk}")


def test_public_api_against_finite_differences():
    """Every gradient of ``qkv.recurrent.delta_rule_backward`` against central differences."""
    q, k, v, beta, g, S0, do, dS = _inputs(7, "unit", True, seed=3, dims=(1, 2, 3, 2))
    args = [q, k, v, beta, g, S0]

    def loss(q, k, v, beta, g, S0):
        o, S = rec.delta_rule(q, k, v, beta, g, scale=0.6, initial_state=S0, return_state=True, chunk_size=3)
        return float((o * do).sum() + (S * dS).sum())

    grads = rec.delta_rule_backward(do, *args[:5], scale=0.6, initial_state=S0, dstate=dS, chunk_size=3)
    for i, name in enumerate(["q", "k", "v", "beta", "log_decay", "initial_state"]):
        x, num = args[i], np.zeros_like(args[i])
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + 1e-6
            up = loss(*args)
            x[idx] = old - 1e-6
            num[idx] = (up - loss(*args)) / 2e-6
            x[idx] = old
        np.testing.assert_allclose(grads[i], num, atol=1e-7, err_msg=name)


def test_extreme_decays_stay_finite():
    """g = -30 every step, and g far below any exponent's range: zeros, never inf or NaN."""
    for dtype, floor in [(np.float32, -3e38), (np.float64, -1e308)]:
        q, k, v, beta, g, S0, do, dS = _inputs(70, "unit", True, dtype=dtype)
        for g_value in (-30.0, floor):
            g = np.full(g.shape, g_value, dtype=dtype)
            o, S = rec.delta_rule(q, k, v, beta, g, initial_state=S0, return_state=True, chunk_size=64)
            grads = rec.delta_rule_backward(do, q, k, v, beta, g, initial_state=S0, dstate=dS, chunk_size=64)
            for x in (o, S, *grads):
                assert np.isfinite(x).all()
            o_ref, S_ref = recurrence.delta_forward(q, k, v, beta, g, scale=DK ** -0.5, initial_state=S0)
            _close(o, o_ref, 1e-5 if dtype == np.float32 else 1e-12, f"o, g = {g_value}")
            if dtype == np.float64:
                want = recurrence.delta_backward(do, dS, q, k, v, beta, g, scale=DK ** -0.5, initial_state=S0)
                for a, b in zip(grads, want):
                    _close(a, b, 1e-10, f"gradient, g = {g_value}")


def _steps32(do, dS, q, k, v, beta, g, scale, S0):
    """The step recurrence and its backward in plain float32 (the oracle's loop, dtype kept):
    the yardstick for the chunked form's float32 error."""
    f = np.float32
    e = np.exp(g)
    S = np.zeros(q.shape[:2] + (q.shape[-1], v.shape[-1]), f) if S0 is None else S0.copy()
    o, before = np.empty(v.shape, f), []
    for t in range(q.shape[2]):
        before.append(S)
        Sp = e[:, :, t, None, None] * S
        u = beta[:, :, t, None] * (v[:, :, t] - np.einsum("bhkv,bhk->bhv", Sp, k[:, :, t]))
        S = Sp + k[:, :, t, :, None] * u[:, :, None, :]
        o[:, :, t] = f(scale) * np.einsum("bhkv,bhk->bhv", S, q[:, :, t])
    S_T = S
    dq, dk, dv, db, dg = (np.zeros(x.shape, f) for x in (q, k, v, beta, g))
    dSt = np.zeros_like(S) if dS is None else dS.copy()
    for t in reversed(range(q.shape[2])):
        kt, bt = k[:, :, t], beta[:, :, t, None]
        dSt = dSt + f(scale) * q[:, :, t, :, None] * do[:, :, t, None, :]
        dq[:, :, t] = f(scale) * np.einsum("bhkv,bhv->bhk", S, do[:, :, t])
        Sp = e[:, :, t, None, None] * before[t]
        r = v[:, :, t] - np.einsum("bhkv,bhk->bhv", Sp, kt)
        du = np.einsum("bhkv,bhk->bhv", dSt, kt)
        dk[:, :, t] = np.einsum("bhkv,bhv->bhk", dSt, bt * r) - bt * np.einsum("bhkv,bhv->bhk", Sp, du)
        dv[:, :, t], db[:, :, t] = bt * du, np.einsum("bhv,bhv->bh", du, r)
        dSp = dSt - (bt * kt)[..., None] * du[:, :, None, :]
        dg[:, :, t] = np.einsum("bhkv,bhkv->bh", dSp, Sp)
        dSt, S = e[:, :, t, None, None] * dSp, before[t]
    return o, S_T, (dq, dk, dv, db, dg, dSt)


FLOAT32_BUDGET = {"forward": 2.0, "backward": 5.0}   # x the float32 step loop's own error (measured: 1.5, 4.0)


@pytest.mark.parametrize("regime", ["unit", "strong", "raw"])
@pytest.mark.parametrize("T", [100, 257])
def test_float32_within_budget_of_the_float32_step_loop(regime, T):
    """float32 in, float32 compute: each result's error against float64 at most the budget
    times the plain float32 step loop's (both relative to the result's largest value)."""
    x64 = _inputs(T, regime, True, seed=1, dims=(1, 2, 16, 12))
    q, k, v, beta, g, S0, do, dS = x64
    o, S = recurrence.delta_forward(q, k, v, beta, g, scale=0.7, initial_state=S0)
    want = [o, S, *recurrence.delta_backward(do, dS, q, k, v, beta, g, scale=0.7, initial_state=S0)]
    x32 = [x.astype(np.float32) for x in x64]
    o, S, grads = _steps32(x32[6], x32[7], *x32[:5], 0.7, x32[5])
    steps = [o, S, *grads]
    q, k, v, beta, g, S0, do, dS = x32
    for chunk in [16, None]:
        o, S = delta.forward(q, k, v, beta, g, scale=0.7, initial_state=S0, chunk=chunk)
        got = [o, S, *delta.backward(do, dS, q, k, v, beta, g, scale=0.7, initial_state=S0, chunk=chunk)]
        for i, name in enumerate(["o", "S_T", "dq", "dk", "dv", "dbeta", "dg", "dS0"]):
            assert got[i].dtype == np.float32, name
            top = np.abs(want[i]).max()
            err, own = (np.abs(x - want[i]).max() / top for x in (got[i], steps[i]))
            budget = FLOAT32_BUDGET["forward" if i < 2 else "backward"] * max(own, np.finfo(np.float32).eps)
            assert err <= budget, f"{name}, chunk {chunk}: {err:.2e} > {budget:.2e} (step loop {own:.2e})"


# --- the outside references (torch) ---------------------------------------------------------

def _torch():
    return pytest.importorskip("torch", reason="the outside references are torch code")


def _bthd(torch, x):
    """Ours ``(B, H, T, ...)`` -> their ``(B, T, H, ...)`` torch tensor (float64)."""
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(x, 2, 1)))


def test_against_fla_delta_rule_recurrence():
    """fla's ``delta_rule_recurrence``: (B, H, T, D), q scaled by Dk^-0.5, float32 inside."""
    torch = _torch()
    from fla_reference import naive
    ref = naive("delta_rule").delta_rule_recurrence
    q, k, v, beta, g, S0, do, dS = _inputs(100, "unit", True, dims=(2, 2, 8, 6))
    o_ref, S_ref = ref(*(torch.from_numpy(x) for x in (q, k, v, beta)), initial_state=torch.from_numpy(S0),
                       output_final_state=True)
    o, S = rec.delta_rule(q, k, v, beta, initial_state=S0, return_state=True, chunk_size=16)
    _close(o, o_ref.double().numpy(), 2e-6, "o")
    _close(S, S_ref.double().numpy(), 2e-6, "S_T")


def test_against_fla_naive_recurrent_gated_delta_rule():
    """fla's gated reference: (B, T, H, D) layout, g (B, T, H), an explicit scale."""
    torch = _torch()
    from fla_reference import naive
    ref = naive("gated_delta_rule").naive_recurrent_gated_delta_rule
    q, k, v, beta, g, S0, do, dS = _inputs(100, "strong", True, dims=(2, 2, 8, 6))
    o_ref, S_ref = ref(*(_bthd(torch, x) for x in (q, k, v, beta, g)), scale=0.4,
                       initial_state=torch.from_numpy(S0), output_final_state=True)
    o, S = rec.delta_rule(q, k, v, beta, g, scale=0.4, initial_state=S0, return_state=True)
    _close(o, np.moveaxis(o_ref.double().numpy(), 1, 2), 2e-6, "o")
    _close(S, S_ref.double().numpy(), 2e-6, "S_T")


def _qwen3_next():
    _torch()
    pytest.importorskip("transformers", reason="transformers' Qwen3-Next functions are a reference here")
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    return m


def _l2norm(x):
    """transformers' (and fla's) ``l2norm``: ``x / sqrt(Σ x² + 1e-6)``."""
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


@pytest.mark.parametrize("name", ["torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule"])
def test_against_transformers_forward(name):
    """Qwen3-Next's functions: (B, T, H, D), scale Dk^-0.5, q and k L2-normalised in the kernel
    (``use_qk_l2norm_in_kernel``), float32 inside (so a float32 tolerance); T = 100 is not a multiple of their chunk."""
    m, torch = _qwen3_next(), _torch()
    q, k, v, beta, g, S0, do, dS = _inputs(100, "raw", True, dims=(2, 2, 8, 6))
    o_ref, S_ref = getattr(m, name)(*(_bthd(torch, x) for x in (q, k, v)), g=_bthd(torch, g), beta=_bthd(torch, beta),
                                    initial_state=torch.from_numpy(S0), output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)
    o, S = rec.delta_rule(_l2norm(q), _l2norm(k), v, beta, g, initial_state=S0, return_state=True)
    _close(o, np.moveaxis(o_ref.double().numpy(), 1, 2), 2e-6, "o")
    _close(S, S_ref.double().numpy(), 2e-6, "S_T")


def test_against_transformers_chunk_gradients():
    """torch autograd through ``torch_chunk_gated_delta_rule`` (float32 inside) against our
    float64 backward: every gradient, with an initial state and a final-state gradient."""
    m, torch = _qwen3_next(), _torch()
    q, k, v, beta, g, S0, do, dS = _inputs(100, "strong", True, dims=(2, 2, 8, 6))
    theirs = [_bthd(torch, x).requires_grad_() for x in (q, k, v, g, beta)] + [torch.from_numpy(S0).requires_grad_()]
    o_ref, S_ref = m.torch_chunk_gated_delta_rule(*theirs[:3], g=theirs[3], beta=theirs[4], initial_state=theirs[5],
                                                  output_final_state=True)
    ((o_ref * _bthd(torch, do)).sum() + (S_ref * torch.from_numpy(dS)).sum()).backward()
    dq, dk, dv, dbeta, dg, dS0 = rec.delta_rule_backward(do, q, k, v, beta, g, initial_state=S0, dstate=dS)
    for name, ours, t in [("dq", dq, theirs[0]), ("dk", dk, theirs[1]), ("dv", dv, theirs[2]), ("dg", dg, theirs[3]),
                          ("dbeta", dbeta, theirs[4])]:
        _close(ours, np.moveaxis(t.grad.numpy(), 1, 2), 3e-5, name)
    _close(dS0, theirs[5].grad.numpy(), 3e-5, "dS0")


def test_same_bits_on_any_thread_count():
    """Heads split over threads: a head's numbers never depend on the split."""
    from qkv import threads
    x = _inputs(900, "strong", True, dims=(1, 5, 40, 24), dtype=np.float32)
    q, k, v, beta, g, S0, do, dS = x
    runs = []
    for n in (1, 2, 3):
        with threads.kernel_threads(n):
            o, S = delta.forward(q, k, v, beta, g, scale=0.3, initial_state=S0, chunk=None)
            grads = delta.backward(do, dS, q, k, v, beta, g, scale=0.3, initial_state=S0, chunk=None)
        runs.append([o, S, *grads])
    assert 5 * 900 * 64 >= delta.SERIAL_WORK      # else every count runs on one thread
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("shape", [(1, 2, 0, 3), (0, 2, 5, 3), (1, 0, 5, 3)])
def test_empty_sequences_and_batches(shape):
    """T = 0 returns the initial state; no heads returns empty arrays (no error, no NaN)."""
    rng = np.random.default_rng(0)
    q, beta, g = rng.standard_normal(shape), np.full(shape[:3], 0.5), np.full(shape[:3], -1.0)
    S0 = rng.standard_normal(shape[:2] + (3, 3))
    o, S = rec.delta_rule(q, q, q, beta, g, initial_state=S0, return_state=True)
    assert o.shape == shape and S.shape == S0.shape
    if shape[2] == 0:
        assert np.array_equal(S, S0)
    grads = rec.delta_rule_backward(q, q, q, q, beta, g, initial_state=S0, dstate=S0)
    assert [x.shape for x in grads] == [shape] * 3 + [shape[:3]] * 2 + [S0.shape]
    if shape[2] == 0:
        assert np.array_equal(grads[-1], S0)          # dS_0 = dstate through no steps


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("keep", [True, False], ids=["backward", "forward"])
@pytest.mark.parametrize("B, H, T, Dk, Dv, C", [(1, 2, 200, 16, 24, 64), (2, 3, 70, 32, 128, 32), (1, 1, 5, 4, 6, 2)])
def test_the_compiled_state_pass_gives_numpys_bits(monkeypatch, gated, keep, B, H, T, Dk, Dv, C):
    """delta_chunks.pass_states in one compiled loop (BLAS's sgemm called from numba) against
    its NumPy loop on the same chunks, bit for bit: corrections, reads, start states, the final
    state and the outputs it makes given the scale; decays down to -30 a step, q of size 30, an initial state, T not a multiple
    of C."""
    from qkv import jit
    from qkv.recurrent.delta import chunk_parts as delta_chunks
    if not jit.enabled():
        pytest.skip("numba (the fast extra) is not installed, or QKV_JIT=0")
    rng = np.random.default_rng(T + Dv)
    q, k = (rng.standard_normal((B, H, T, Dk), dtype=np.float32) for _ in range(2))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, H, T, Dv), dtype=np.float32)
    beta = rng.uniform(0, 1, (B, H, T)).astype(np.float32)
    g = (-30 * rng.random((B, H, T)) ** 3).astype(np.float32) if gated else None
    S0 = rng.standard_normal((B, H, Dk, Dv), dtype=np.float32)
    ch = delta_chunks.prepare(30 * q, k, v, beta, g, C, keep=keep)
    mod, calls = jit.load(jit.DELTA), []
    real = mod.pass_chunks
    monkeypatch.setattr(mod, "pass_chunks", lambda *a: calls.append(1) or real(*a))
    fused = delta_chunks.pass_states(ch, S0, keep=keep, scale=0.3)
    assert calls, "the compiled pass did not run"
    monkeypatch.setattr(jit, "load", lambda name: None)
    plain = delta_chunks.pass_states(ch, S0, keep=keep, scale=0.3)
    assert plain.O is None
    want = ch.P @ plain.U                                               # the forward's NumPy lines
    want += plain.QS
    want *= 0.3
    np.testing.assert_array_equal(fused.O, want)
    for name in ("U", "KS", "QS", "starts", "S"):
        got, want = getattr(fused, name), getattr(plain, name)
        if want is None:
            assert got is None and not keep
            continue
        assert got.dtype == np.float32 and np.all(np.isfinite(got))
        np.testing.assert_array_equal(got, want, err_msg=name)


# --- steep decays: every gradient, dlog_decay included, against the largest true entry ------

def _steep(T, steep, seed=3):
    x = list(_inputs(T, "unit", True, seed=seed))
    rng = np.random.default_rng(seed + 100)
    if steep == "resets":                                 # a fifth of the steps at -30, -1e4, -3e38
        g = -rng.uniform(0, 1, x[4].shape)
        hit = rng.random(g.shape) < 0.2
        g[hit] = rng.choice([-30.0, -1e4, -3e38], size=int(hit.sum()))
    else:
        g = np.full(x[4].shape, float(steep))
    x[4] = g
    return x


def _rel(x, ref):
    return float(np.abs(np.asarray(x, np.float64) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("steep", [-10, -20, -30, "resets"])
@pytest.mark.parametrize("chunk", [None, 16])
def test_steep_decays_every_gradient_to_1e_10_in_float64(steep, chunk):
    """At g = -30 a step the true dg is about exp(-30) of the other gradients; dg written as a
    reversed sum of rowsum - colsum kept 3 digits of it (2.6e-3); now 1e-10 of each array's
    largest true entry, for every output and gradient (qkv.recurrent.crossing)."""
    q, k, v, beta, g, S0, do, dS = _steep(100, steep)
    o, S = rec.delta_rule(q, k, v, beta, g, scale=0.7, initial_state=S0, return_state=True, chunk_size=chunk)
    want = [*recurrence.delta_forward(q, k, v, beta, g, scale=0.7, initial_state=S0),
            *recurrence.delta_backward(do, dS, q, k, v, beta, g, scale=0.7, initial_state=S0)]
    got = [o, S, *rec.delta_rule_backward(do, q, k, v, beta, g, scale=0.7, initial_state=S0, dstate=dS,
                                          chunk_size=chunk)]
    for name, a, b in zip(["o", "S_T", "dq", "dk", "dv", "dbeta", "dg", "dS0"], got, want):
        assert _rel(a, b) <= 1e-10, name


@pytest.mark.parametrize("steep", [-10, -20, -30, "resets"])
def test_steep_decays_float32_within_budget_of_the_float32_step_loop(steep):
    """float32 at steep decays: dg was 0.8-1.0 of its largest true entry off at g = -20, -30."""
    x64 = _steep(100, steep, seed=4)
    q, k, v, beta, g, S0, do, dS = x64
    want = recurrence.delta_backward(do, dS, q, k, v, beta, g, scale=0.7, initial_state=S0)
    x32 = [np.maximum(x, np.finfo(np.float32).min).astype(np.float32) for x in x64]
    steps = _steps32(x32[6], x32[7], *x32[:5], 0.7, x32[5])[2]
    q, k, v, beta, g, S0, do, dS = x32
    got = rec.delta_rule_backward(do, q, k, v, beta, g, scale=0.7, initial_state=S0, dstate=dS)
    for name, a, s, w in zip(["dq", "dk", "dv", "dbeta", "dg", "dS0"], got, steps, want):
        budget = FLOAT32_BUDGET["backward"] * max(_rel(s, w), np.finfo(np.float32).eps)
        assert _rel(a, w) <= budget, name
