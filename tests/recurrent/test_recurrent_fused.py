"""The recurrent layers' compiled passes (the ``fast`` extra): the short causal convolution
(forward and backward, any dtype) and float32 SiLU (forward and backward, σ from the flash
kernel's ``2^x``), against the NumPy passes and float64 formulas; and the three layers whole,
compiled against NumPy."""
import numpy as np
import pytest

from qkv import jit, nn
from qkv.nn import activations, fusion, recurrent_parts

needs_fast = pytest.mark.skipif(fusion.module() is None,
                                reason="numba is not installed (pip install -e '.[fast]') or QKV_JIT=0")


def rng(seed=0):
    return np.random.default_rng(seed)


def numpy_path(monkeypatch):
    monkeypatch.setitem(jit._loaded, fusion.MODULE, None)


def delta_path(path, monkeypatch):
    """The delta rule's NumPy passes (``path == "numpy"``) or its compiled ones (skipped without)."""
    if path == "numpy":
        monkeypatch.setitem(jit._loaded, jit.DELTA, None)
    elif jit.load(jit.DELTA) is None:
        pytest.skip("numba is not installed (pip install -e '.[fast]') or QKV_JIT=0")


def silu64(a):
    a = np.asarray(a, np.float64)
    return a / (1.0 + np.exp(-a))


@needs_fast
def test_silu_float32_compiled_is_within_a_few_ulps_and_saves_no_sigmoid():
    a = np.concatenate([np.linspace(-30, 30, 200001), [-200, -88.5, -87, -1e-30, 0, 1e-30, 88.5, 200]]).astype(np.float32)
    y, saved = activations.silu_forward(a)
    assert y.dtype == np.float32 and saved[1] is None             # σ is computed again by the backward
    ref = silu64(a)
    moderate = np.abs(a) < 20
    assert np.max(np.abs(y - ref)[moderate] / np.maximum(np.abs(ref[moderate]), 1e-30)) < 4e-7
    assert np.max(np.abs(y - ref)) < 4e-6                        # the far tail: 0 against ~1e-36
    assert y[-1] == np.float32(200) and y[-8] <= 0 and y[-8] > -1e-30
    far, _ = activations.silu_forward(np.array([-1e10, -1e30, -3e38, 1e10, 3e38], np.float32))
    assert np.array_equal(far, np.array([0, 0, 0, 1e10, 3e38], np.float32)) and np.all(np.isfinite(far))  # exact


@needs_fast
def test_silu_float32_backward_against_float64():
    r = rng(1)
    a = (r.standard_normal((3, 41, 17)) * 8).astype(np.float32)
    dy = r.standard_normal(a.shape).astype(np.float32)
    _, saved = activations.silu_forward(a)
    dh = activations.silu_backward(dy, saved)
    s = 1 / (1 + np.exp(-a.astype(np.float64)))
    want = dy * s * (1 + a * (1 - s))
    assert dh.dtype == np.float32
    assert np.max(np.abs(dh - want)) < 3e-6 * max(1.0, np.max(np.abs(want)))


@needs_fast
def test_silu_keeps_nan_and_takes_a_strided_input():
    a = np.zeros((4, 10), np.float32)
    a[1, 3] = np.nan
    y, _ = activations.silu_forward(a[:, ::2])                    # not contiguous: copied, then compiled
    assert np.isnan(y[1]).sum() == 0 and y.shape == (4, 5)
    y, saved = activations.silu_forward(a)
    assert np.isnan(y[1, 3]) and np.isnan(activations.silu_backward(np.ones_like(a), saved)[1, 3])


@needs_fast
def test_silu_saved_by_the_compiled_pass_survives_jit_turned_off(monkeypatch):
    a = rng(2).standard_normal((5, 7)).astype(np.float32)
    dy = np.ones_like(a)
    _, saved = activations.silu_forward(a)
    compiled = activations.silu_backward(dy, saved)
    numpy_path(monkeypatch)
    assert np.allclose(activations.silu_backward(dy, saved), compiled, rtol=1e-5, atol=1e-6)


def conv_oracle(u, w, b, prefix):
    """The convolution written out, in float64: y_t = b + Σ_j w[:, j] ũ_{t+j}."""
    B, T, C = u.shape
    K = w.shape[1]
    pad = np.concatenate([np.zeros((B, K - 1, C)) if prefix is None else prefix, u], axis=1).astype(np.float64)
    y = np.zeros((B, T, C)) + (0 if b is None else b)
    for t in range(T):
        for j in range(K):
            y[:, t] += w[:, j] * pad[:, t + j]
    return y, pad


@pytest.mark.parametrize("path", ["numpy", "fused"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("K,T,bias,prefix", [(4, 19, True, True), (3, 1, False, False), (2, 7, False, True),
                                             (5, 3, True, False)])
def test_conv_forward_and_backward(path, dtype, K, T, bias, prefix, monkeypatch):
    if path == "numpy":
        numpy_path(monkeypatch)
    elif fusion.module() is None:
        pytest.skip("numba is not installed (pip install -e '.[fast]') or QKV_JIT=0")
    r = rng(K * 100 + T)
    B, C = 2, 33
    u, w = r.standard_normal((B, T, C)), r.standard_normal((C, K))
    b = r.standard_normal(C) if bias else None
    pre = r.standard_normal((B, K - 1, C)) if prefix else None
    cast = lambda x: None if x is None else x.astype(dtype)  # noqa: E731
    y, padded = recurrent_parts.conv_forward(cast(u), cast(w), cast(b), cast(pre))
    want, pad = conv_oracle(u, w, b, pre)
    tol = 1e-13 if dtype == np.float64 else 2e-5
    assert y.dtype == dtype and np.max(np.abs(y - want)) < tol
    assert np.array_equal(recurrent_parts.conv_tail(padded, K), pad[:, T:].astype(dtype))
    dy = r.standard_normal((B, T, C))
    du, dw, db = recurrent_parts.conv_backward(cast(dy)[:, ::1], padded, cast(w))
    dpad = np.zeros_like(pad)
    dw_want = np.zeros((C, K))
    for t in range(T):
        for j in range(K):
            dw_want[:, j] += np.sum(dy[:, t] * pad[:, t + j], axis=0)
            dpad[:, t + j] += w[:, j] * dy[:, t]
    assert du.dtype == dw.dtype == dtype and du.shape == u.shape and dw.shape == w.shape
    assert np.max(np.abs(du - dpad[:, K - 1:])) < tol * 10
    assert np.max(np.abs(dw - dw_want)) < tol * 10
    assert np.allclose(db, dy.sum(axis=(0, 1)), rtol=1e-5)


@needs_fast
def test_conv_backward_is_the_same_bits_every_call():
    r = rng(7)
    u = r.standard_normal((3, 300, 40)).astype(np.float32)
    w = r.standard_normal((40, 4)).astype(np.float32)
    dy = r.standard_normal(u.shape).astype(np.float32)
    _, padded = recurrent_parts.conv_forward(u, w, None, None)
    first = recurrent_parts.conv_backward(dy, padded, w)
    for _ in range(3):
        again = recurrent_parts.conv_backward(dy, padded, w)
        assert all(np.array_equal(a, b) for a, b in zip(first, again))


LAYERS = {
    "mamba2": lambda dt: nn.Mamba2(24, 4, 12, 8, n_groups=2, dtype=dt, rng=rng(3)),
    "gated_delta": lambda dt: nn.GatedDeltaNet(24, 2, 4, 8, 6, dtype=dt, rng=rng(3)),
    "rglru": lambda dt: nn.RGLRU(24, 16, 4, dtype=dt, rng=rng(3)),
}


@needs_fast
@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_layers_compiled_equal_their_numpy_passes(kind, dtype, monkeypatch):
    """Forward and every gradient, through the compiled conv and SiLU and through NumPy's."""
    x = rng(4).standard_normal((2, 37, 24)).astype(dtype)
    dy = rng(5).standard_normal(x.shape).astype(dtype)

    def run():
        layer = LAYERS[kind](dtype)
        y = layer.forward(x)
        return y, layer.backward(dy), {k: g.copy() for k, g in layer.grads.items()}

    y1, dx1, g1 = run()
    numpy_path(monkeypatch)
    y0, dx0, g0 = run()
    tol = 1e-12 if dtype == np.float64 else 2e-4
    scale = lambda a: max(1.0, float(np.max(np.abs(a))))  # noqa: E731
    assert np.max(np.abs(y1 - y0)) < tol * scale(y0)
    assert np.max(np.abs(dx1 - dx0)) < tol * scale(dx0)
    for name in g0:
        assert np.max(np.abs(g1[name] - g0[name])) < tol * scale(g0[name]), name


@pytest.mark.parametrize("path", ["numpy", "fused"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_delta_chunks_unit_lower_inverse(path, dtype, monkeypatch):
    """``(I + A)⁻¹`` of a strictly lower ``A``: the compiled forward substitution and NumPy's block
    doubling, against ``np.linalg.inv``; what is on the diagonal is not read (above it: zeros, as
    the kernel's ``A = β (K Kᵀ) ∘ D`` has)."""
    from qkv.recurrent.delta import chunk_parts as delta_chunks
    delta_path(path, monkeypatch)
    r = rng(11)
    for C in (1, 2, 15, 16, 17, 64):
        k = r.standard_normal((3, 2, C, 8))
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        A = np.tril(k @ np.swapaxes(k, -1, -2) * r.uniform(0, 1, (3, 2, C, 1))).astype(dtype)  # β (K Kᵀ) ∘ D
        want = np.linalg.inv(np.eye(C) + np.tril(A.astype(np.float64), -1))
        X = delta_chunks.unit_lower_inverse(A.copy())
        assert X.shape == A.shape and X.dtype == dtype
        assert np.max(np.abs(X - want)) < (1e-12 if dtype == np.float64 else 2e-5), C
        strided = np.swapaxes(np.swapaxes(A, -1, -2).copy(), -1, -2)          # not C-contiguous: NumPy's path
        assert np.max(np.abs(delta_chunks.unit_lower_inverse(strided) - want)) < (1e-12 if dtype == np.float64 else 2e-5)


def _systems_oracle(scores, gamma, beta):
    """float64 ``(D, P, Tinv)`` written out: ``D_ts = e^{γ_t - γ_s}`` (s <= t), ``P = (Q Kᵀ) ∘ D``,
    ``Tinv = (I + strictly_lower(diag(β) (K Kᵀ) ∘ D))⁻¹``."""
    C = gamma.shape[-1]
    diff = gamma[..., :, None] - gamma[..., None, :]
    D = np.where(np.tril(np.ones((C, C), bool)), np.exp(np.minimum(diff, 0)), 0.0)
    KK, QK = scores[..., :C, :].astype(np.float64), scores[..., C:, :].astype(np.float64)
    A = np.tril(KK * D * beta[..., :, None].astype(np.float64), -1)
    return D, QK * D, np.linalg.inv(np.eye(C) + A)


@pytest.mark.parametrize("path", ["numpy", "fused"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_delta_chunk_systems_against_float64(path, dtype, monkeypatch):
    """The delta rule's in-chunk quantities (:func:`qkv.recurrent.delta.chunk_parts._systems`): the decays,
    the masked scores (in place) and ``(I + A)⁻¹``, on the compiled pass and NumPy's, against
    float64, at steps down to -30 (decays underflow to 0, never NaN), no decay, C = 1 ... 64, with
    D kept or not. float32 decays are at least as close to float64 as NumPy's own float32 exp."""
    from qkv.recurrent.delta import chunk_parts as delta_chunks
    flush = delta_chunks.FLUSH
    delta_path(path, monkeypatch)
    r = rng(12)
    for C in (1, 2, 7, 16, 33, 64):
        for steps in ("none", "mild", "steep"):
            kq = r.standard_normal((2, 3, 2 * C, 8))
            kq /= np.linalg.norm(kq, axis=-1, keepdims=True)
            scores = (kq @ np.swapaxes(kq[..., :C, :], -1, -2)).astype(dtype)     # [K Kᵀ; Q Kᵀ]
            beta = r.uniform(0, 1, (2, 3, C)).astype(dtype)
            g = None if steps == "none" else -r.uniform(0, 0.2 if steps == "mild" else 30, (2, 3, C))
            gamma = delta_chunks.cumulative(g)
            D0, P0, T0 = _systems_oracle(scores, np.zeros((2, 3, C)) if gamma is None else gamma, beta)
            for keep in (True, False):
                got = scores.copy()
                D, Tinv = delta_chunks._systems(got, gamma, beta, keep)
                assert Tinv.dtype == dtype and Tinv.shape == (2, 3, C, C)
                tol = 1e-13 if dtype == np.float64 else 3e-6
                assert np.all(np.isfinite(got)) and np.all(np.isfinite(Tinv))
                assert np.max(np.abs(got[..., C:, :] - P0)) < tol, (C, steps)
                assert np.array_equal(got[..., :C, :], scores[..., :C, :])             # K Kᵀ is left as it was
                assert np.max(np.abs(Tinv - T0)) < tol * 10, (C, steps)
                if D is not None:
                    # float32: the compiled pass about 2 ulps; NumPy's exp of the difference rounded to
                    # float32 first, |γ_t - γ_s| ulps of the argument more
                    gap = 0 if gamma is None else np.abs(gamma[..., :, None] - gamma[..., None, :])
                    rel = 2.5e-7 if path == "fused" else 1.2e-7 * (2 + gap)
                    # relative where D is a normal float32; below (1.2e-38), within that of 0
                    # (the compiled float32 pass makes a decay below FLUSH = 2^-60 exactly 0)
                    floor = flush if path == "fused" and dtype == np.float32 else np.finfo(np.float32).tiny
                    err = np.abs(D - D0)
                    ok = (err <= (1e-15 if dtype == np.float64 else rel) * D0) | (err <= floor)
                    assert D.dtype == dtype and np.all(ok), (C, steps)
                    assert np.all(np.triu(D, 1) == 0) and np.all(np.diagonal(D, axis1=-2, axis2=-1) == 1)
                else:
                    assert path == "fused" and not keep


def test_delta_float32_keeps_out_of_subnormals():
    """With transformers' initial decays (Qwen3-Next: ``A`` up to 16, steps near -20) float32
    ``(I + A)⁻¹`` once held subnormal entries (1 in 60), and every product reading them took
    Intel's slow path: the compiled pass makes entries below ``FLUSH`` (2^-60) 0, so none of the
    chunk's quantities is subnormal, and the outputs stay within float32's budget of float64.
    NaN in the inputs still reaches the output."""
    from qkv import recurrent
    from qkv.recurrent.delta import chunk_parts as delta_chunks
    if jit.load(jit.DELTA) is None:
        pytest.skip("numba is not installed (pip install -e '.[fast]') or QKV_JIT=0")
    r = rng(13)
    B, H, T, D = 1, 4, 256, 32
    q, k = (r.standard_normal((B, H, T, D)) for _ in range(2))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = r.standard_normal((B, H, T, D))
    beta = r.uniform(0, 1, (B, H, T))
    g = -r.uniform(0, 16, (1, H, 1)) * np.log1p(np.exp(1 + 0.5 * r.standard_normal((B, H, T))))
    f32 = [x.astype(np.float32) for x in (q, k, v, beta, g)]
    ch = delta_chunks.prepare(*f32, 64)
    tiny = np.finfo(np.float32).tiny
    for name in ("eg", "eCg", "D", "P", "Tinv", "Kc"):
        x = np.abs(getattr(ch, name))
        assert not np.any((x > 0) & (x < tiny)), name
    assert np.count_nonzero(np.abs(ch.Tinv) < delta_chunks.FLUSH) > 0     # the steep heads do flush
    from qkv.recurrent.delta import compiled as delta_compiled
    assert delta_compiled.FLUSH == delta_chunks.FLUSH                     # the compiled and NumPy sides agree
    o32 = recurrent.delta_rule(*f32)
    o64 = recurrent.delta_rule(q, k, v, beta, g)
    assert np.max(np.abs(o32 - o64)) < 1e-5 * np.max(np.abs(o64))
    f32[2][0, 1, 100, 3] = np.nan
    o = recurrent.delta_rule(*f32)
    assert np.isnan(o[0, 1, 100:, 3]).all() and np.isfinite(o[0, 0]).all()   # (value columns are independent)


@needs_fast
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rglru_backward_pass_gives_numpys_bits(dtype, monkeypatch):
    """The RG-LRU's element-wise backward (``fused.rglru_backward``: the gates' pre-activation
    gradients, ``du``'s direct part, ``dlog a`` through ``m = sqrt(1 - a²)``) rounds as the NumPy
    path does: the same bits, with the reset at position 0 and without (a continued sequence),
    the square root's derivative at its bound (a → 1) and NaN in the upstream gradient."""
    r = rng(4)
    layer = nn.RGLRU(24, 36, 3, rng=r, dtype=dtype)
    layer.params["recurrent_param"][:4] = -30.0                      # a = 1 - tiny: 1 - a² at the bound
    x = (3 * r.standard_normal((2, 21, 24))).astype(dtype)
    outs = {}
    for reset in (True, False):
        state = None if reset else layer.new_state(2)
        if state is not None:
            layer.forward(x[:, :4], state=state)
        layer.forward(x, state=state)
        saved = layer._need_saved()
        dxin = r.standard_normal((2, 21, 36)).astype(dtype)
        dxin[0, 3, 5] = np.nan
        dla = r.standard_normal((2, 21, 36)).astype(dtype)
        outs[reset] = (saved, dxin, dla)
    got = {k: layer._gates_backward(*v) for k, v in outs.items()}
    numpy_path(monkeypatch)
    want = {k: layer._gates_backward(*v) for k, v in outs.items()}
    for k in got:
        for a, b in zip(got[k], want[k], strict=True):
            assert a.dtype == dtype and a.shape == b.shape
            np.testing.assert_array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))
