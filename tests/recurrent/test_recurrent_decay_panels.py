"""The decay kernel's forward in value panels (qkv.recurrent.decay.chunk: values, states and outputs
cut into PANEL-column panels where Dv is a larger multiple of PANEL, the rows' exp(G_i)
applied to finished output rows) and its compiled scan of the states, against the float64
step oracle and NumPy's own loop."""
import numpy as np
import pytest

from qkv import jit
from qkv.recurrent.decay import chunk as decay, naive as R


def problem(rng, T, Dk, Dv, per_channel, *, H=2, dtype=np.float64, strong=True):
    """q, k, v, g, S0: the decays weak in the first half (a head's chunks factored) and, where
    ``strong``, down to exp(-30) a step in the second (its (C, C) exps): a call of slabs of a
    few chunks takes both paths."""
    q, k = (rng.standard_normal((1, H, T, Dk)) for _ in range(2))
    v = rng.standard_normal((1, H, T, Dv))
    shape = (1, H, T, Dk) if per_channel else (1, H, T)
    g = -rng.random(shape) ** 3
    g[:, :, T // 2:] *= 30.0 if strong else 1.0
    S0 = rng.standard_normal((1, H, Dk, Dv))
    return [x.astype(dtype) for x in (q, k, v, g, S0)]


def close(got, want, tol):
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * max(1.0, float(np.abs(want).max())))


def merged_products_round_as_apart() -> bool:
    """Whether NumPy's BLAS rounds products made side by side (``Q [S | K]``, ``[A ; K] V``: the
    compiled decay loop's one-panel form) as it rounds them apart. OpenBLAS's AVX-512 kernels
    do; its Haswell kernels do not always."""
    rng = np.random.default_rng(0)
    Q, S, K, A, V = (rng.standard_normal(s, dtype=np.float32) for s in ((64, 48), (48, 40), (48, 64), (64, 64), (64, 40)))
    return (np.array_equal(Q @ np.concatenate([S, K], 1), np.concatenate([Q @ S, Q @ K], 1))
            and np.array_equal(np.concatenate([A, K], 0) @ V, np.concatenate([A @ V, K @ V], 0)))


def same_as_numpy(got, want, one_panel: bool):
    """The compiled decay forward against the NumPy path: the same bits, or, in one panel where
    the BLAS rounds merged products otherwise, within float32's rounding of them."""
    if one_panel and not merged_products_round_as_apart():
        close(got, want, 1e-5)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("per_channel", [False, True], ids=["head", "channel"])
@pytest.mark.parametrize("panel, Dv", [(2, 6), (3, 6), (2, 5), (4, 12)])
@pytest.mark.parametrize("T, chunk", [(100, 16), (64, 8), (7, None)])
@pytest.mark.parametrize("strong", [True, False], ids=["mixed", "weak"])
def test_panels_equal_the_step_oracle(monkeypatch, per_channel, panel, Dv, T, chunk, strong):
    """Panels of 2 and 3 columns of Dv = 6 (3 and 2 panels), Dv = 5 (not a multiple: one),
    T a multiple of the chunk and not, with and without an initial state; slabs of 32 rows,
    so that a head's factored and unfactored chunks meet in one call."""
    monkeypatch.setattr(decay, "PANEL", panel)
    monkeypatch.setattr(decay, "PANELS", True)
    monkeypatch.setattr(decay, "SLAB_ROWS", 32)
    rng = np.random.default_rng(T + Dv + panel)
    q, k, v, g, S0 = problem(rng, T, 4, Dv, per_channel, strong=strong)
    for state in (S0, None):
        o, S_T = decay.forward(q, k, v, g, scale=0.7, initial_state=state, chunk=chunk)
        o_ref, S_ref = R.decay_forward(q, k, v, g, scale=0.7, initial_state=state)
        close(o, o_ref, 1e-10)
        close(S_T, S_ref, 1e-10)


@pytest.mark.parametrize("per_channel", [False, True], ids=["head", "channel"])
@pytest.mark.parametrize("panels", [True, False])
def test_panels_at_the_widths_models_use(monkeypatch, per_channel, panels):
    """Dv = 128 (two panels of 64) and 192 (three), float64 against the oracle, with panels
    and without (as an AVX2 OpenBLAS runs it)."""
    monkeypatch.setattr(decay, "PANELS", panels)
    rng = np.random.default_rng(5)
    for Dv in (128, 192):
        q, k, v, g, S0 = problem(rng, 150, 16, Dv, per_channel, H=1)
        o, S_T = decay.forward(q, k, v, g, scale=0.25, initial_state=S0, chunk=32)
        o_ref, S_ref = R.decay_forward(q, k, v, g, scale=0.25, initial_state=S0)
        close(o, o_ref, 1e-10)
        close(S_T, S_ref, 1e-10)


def test_panels_in_segments_give_the_bits_of_one_pass(monkeypatch):
    rng = np.random.default_rng(8)
    q, k, v, g, S0 = problem(rng, 300, 4, 6, False, dtype=np.float32)
    monkeypatch.setattr(decay, "PANEL", 2)
    monkeypatch.setattr(decay, "PANELS", True)
    monkeypatch.setattr(decay, "SLAB_ROWS", 32)
    whole = decay.forward(q, k, v, g, scale=0.5, initial_state=S0, chunk=8)
    monkeypatch.setattr(decay, "SEGMENT_ROWS", 64)
    parts = decay.forward(q, k, v, g, scale=0.5, initial_state=S0, chunk=8)
    for a, b in zip(parts, whole):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("W", [1, 5])
@pytest.mark.parametrize("forward", [True, False])
def test_the_compiled_scan_gives_numpys_bits(monkeypatch, dtype, W, forward):
    """decay_compiled.pass_states against the NumPy loop it replaces, bit for bit (states of
    ±1e3 and decays across [0, 1], values and decays rounded as the kernel rounds them)."""
    if not jit.enabled():
        pytest.skip("numba (the fast extra) is not installed, or QKV_JIT=0")
    rng = np.random.default_rng(W)
    S = (1e3 * rng.standard_normal((3, 9, 2, 5, 4))).astype(dtype)
    e = rng.random((3, 8, W)).astype(dtype)
    compiled = S.copy()
    decay._pass_states(compiled, e, forward)
    monkeypatch.setattr(jit, "load", lambda name: None)
    plain = S.copy()
    decay._pass_states(plain, e, forward)
    assert not np.array_equal(plain, S)
    np.testing.assert_array_equal(compiled, plain)


def test_the_blas_core_is_read():
    """qkv.threads.blas_core names NumPy's OpenBLAS core (lower case) where it is OpenBLAS."""
    from qkv import threads
    info = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    core = threads.blas_core()
    assert core == core.lower()
    if "openblas" in info["name"]:
        assert core, "NumPy's OpenBLAS did not give its core"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("W", [1, 6])
def test_the_compiled_kgt_gives_numpys_bits(monkeypatch, dtype, W):
    """The chunks' Kgᵀ (decay_compiled.scaled_transpose) against NumPy's strided product."""
    if not jit.enabled():
        pytest.skip("numba (the fast extra) is not installed, or QKV_JIT=0")
    rng = np.random.default_rng(W)
    q, k, v = (rng.standard_normal((2, 40, 6)).astype(dtype) for _ in range(3))
    g = -3 * rng.random((2, 40, W)).astype(dtype)
    compiled = decay._chunks(q, k, v, g, 16).KgT.copy()
    monkeypatch.setattr(jit, "load", lambda name: None)
    plain = decay._chunks(q, k, v, g, 16).KgT
    assert plain.shape == (2, 3, 6, 16)
    np.testing.assert_array_equal(compiled, plain)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("per_channel", [False, True], ids=["head", "channel"])
@pytest.mark.parametrize("panel, Dv, T, chunk", [(None, 6, 64, 16), (None, 6, 100, 16), (2, 6, 100, 16), (2, 4, 64, 8)])
def test_the_compiled_last_pass_gives_numpys_bits(monkeypatch, dtype, per_channel, panel, Dv, T, chunk):
    """The forward's last pass (decay_compiled.finish: ``out = (o + AV) · row``, panels undone,
    the padded rows dropped) against NumPy's ``o += AV`` and product, bit for bit, through the
    whole forward: with and without panels, T a multiple of the chunk (the output written in
    place) or not, a head's chunks factored and not, a decay a channel."""
    if not jit.enabled():
        pytest.skip("numba (the fast extra) is not installed, or QKV_JIT=0")
    if panel:
        monkeypatch.setattr(decay, "PANEL", panel)
        monkeypatch.setattr(decay, "PANELS", True)
    q, k, v, g, S0 = problem(np.random.default_rng(T + Dv), T, 5, Dv, per_channel, dtype=dtype)
    args = (30 * q, k, v, g)
    compiled = decay.forward(*args, scale=0.3, initial_state=S0, chunk=chunk)
    monkeypatch.setattr(jit, "load", lambda name: None)
    plain = decay.forward(*args, scale=0.3, initial_state=S0, chunk=chunk)
    one_panel = dtype == np.float32 and not per_channel and decay._panels(Dv) == 1
    for got, want in zip(compiled, plain):
        assert got.dtype == dtype and np.all(np.isfinite(got))
        same_as_numpy(got, want, one_panel)


@pytest.mark.parametrize("panels", [True, False])
@pytest.mark.parametrize("T, Dk, Dv, chunk, slab", [(300, 8, 12, 16, 32), (256, 16, 16, None, 2048),
                                                    (130, 32, 128, 64, 128), (1, 4, 6, None, 2048)])
def test_the_compiled_forward_gives_numpys_bits(monkeypatch, panels, T, Dk, Dv, chunk, slab):
    """The whole float32 forward of a decay a head in one compiled loop (decay_fused, BLAS called
    from numba) against the NumPy path, bit for bit (in one panel: where the BLAS rounds merged
    products as apart, see same_as_numpy): panels or not, T a multiple of the chunk
    or not, slabs whose chunks take the rank-one factors and slabs that take the mask (decays
    down to -30 a step), q of size 30, with and without an initial state, several heads a
    unit, and inputs seen through a (B, T, H, D) transpose; T = 1 (a chunk of one row, which the
    loop leaves to NumPy's gemv) too."""
    if not jit.enabled():
        pytest.skip("numba (the fast extra) is not installed, or QKV_JIT=0")
    from qkv.recurrent.decay import fused as decay_fused
    monkeypatch.setattr(decay, "PANEL", 4 if Dv % 4 == 0 and Dv < 64 else decay.PANEL)
    monkeypatch.setattr(decay, "PANELS", panels)
    monkeypatch.setattr(decay, "SLAB_ROWS", slab)
    rng = np.random.default_rng(T + Dk + Dv)
    q, k, v, g, S0 = problem(rng, T, Dk, Dv, False, H=3, dtype=np.float32)
    q = np.ascontiguousarray(np.swapaxes(30 * q, 1, 2)).swapaxes(1, 2)     # (B, T, H, D) seen as (B, H, T, D)
    ran, real = [], decay_fused.forward

    def spy(*a):
        got = real(*a)
        ran.append(got is not None)
        return got
    monkeypatch.setattr(decay_fused, "forward", spy)
    for state in (S0, None):
        ran.clear()
        fused = decay.forward(q, k, v, g, scale=0.3, initial_state=state, chunk=chunk)
        assert ran and (all(ran) if T > 1 else not any(ran))
        with monkeypatch.context() as m:
            m.setattr(decay_fused, "forward", lambda *a: None)
            plain = decay.forward(q, k, v, g, scale=0.3, initial_state=state, chunk=chunk)
        for got, want in zip(fused, plain):
            assert got.dtype == np.float32 and np.all(np.isfinite(got))
            same_as_numpy(got, want, decay._panels(Dv) == 1)
        o_ref, S_ref = R.decay_forward(*(x.astype(np.float64) for x in (q, k, v, g)), scale=0.3,
                                       initial_state=None if state is None else state.astype(np.float64))
        close(fused[0], o_ref, 2e-5)
        close(fused[1], S_ref, 2e-5)


def test_the_compiled_forward_leaves_q_is_k_to_numpy(monkeypatch):
    """q and k the same array (T a whole number of chunks, so the chunks are views of it): NumPy's
    q kᵀ is then syrk, whose bits the compiled loop's sgemm need not give; the loop steps aside."""
    if not jit.enabled():
        pytest.skip("numba (the fast extra) is not installed, or QKV_JIT=0")
    from qkv.recurrent.decay import fused as decay_fused
    q, _, v, g, _ = problem(np.random.default_rng(3), 192, 8, 8, False, dtype=np.float32)
    ran, real = [], decay_fused.forward
    monkeypatch.setattr(decay_fused, "forward", lambda *a: ran.append(real(*a)) or ran[-1])
    both = decay.forward(q, q, v, g, scale=0.5, chunk=32)
    assert ran and all(r is None for r in ran)
    monkeypatch.setattr(jit, "load", lambda name: None)
    for got, want in zip(both, decay.forward(q, q, v, g, scale=0.5, chunk=32)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("C, sub, Dk", [(64, 16, 64), (64, 16, 128), (50, 16, 24), (32, 7, 5), (16, 16, 1)])
def test_the_compiled_channel_scores_give_einsums_bits(monkeypatch, dtype, C, sub, Dk):
    """A decay a key channel: the scores' diagonal blocks made in one compiled pass, their
    decays multiplied row by row as it goes (decay_compiled.channel_scores), against NumPy's
    einsum over the stored (c, c, Dk) products, bit for bit: slab views (not contiguous),
    scores of ±30 magnitude, decays down to exp(-30) a step (products that underflow)."""
    if not jit.enabled():
        pytest.skip("numba (the fast extra) is not installed, or QKV_JIT=0")
    from qkv.recurrent.decay import intra as decay_intra
    rng = np.random.default_rng(C + Dk)
    g = -30 * rng.random((3, 6, C, Dk)) ** 3
    a = np.exp(g).astype(dtype)[:, 1:-1]
    q, k = ((30 * rng.standard_normal((3, 6, C, Dk))).astype(dtype)[:, 1:-1] for _ in range(2))
    compiled = decay_intra.ChannelDecay(a, sub).scores(q, k)
    monkeypatch.setattr(jit, "load", lambda name: None)
    plain = decay_intra.ChannelDecay(a, sub).scores(q, k)
    assert np.all(np.diagonal(plain, axis1=-2, axis2=-1) != 0)                 # E_ii = 1: every row made
    assert np.all(np.triu(plain, 1) == 0) and np.all(np.isfinite(plain))
    np.testing.assert_array_equal(compiled, plain)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("W", [1, 7])
def test_the_compiled_cumulative_decay_gives_numpys_bits(monkeypatch, dtype, W):
    """``G = cumsum(max(g, FLOOR))`` over each chunk in float64 (decay_compiled.chunk_cumsum)
    against NumPy's three calls, bit for bit: steep decays, one below the floor, -inf and NaN
    (kept, as np.maximum keeps it), a strided slab view."""
    if not jit.enabled():
        pytest.skip("numba (the fast extra) is not installed, or QKV_JIT=0")
    from qkv.recurrent.decay import intra as decay_intra
    g = (-30 * np.random.default_rng(W).random((3, 6, 64, W)) ** 3).astype(dtype)
    g[0, 1, 3, 0], g[1, 2, 5, -1], g[2, 3, 1, 0], g[2, 4, 0, -1] = np.nan, -1e5, -np.inf, -2e3
    compiled = decay_intra.cumulative(g[:, 1:], decay.FLOOR)
    monkeypatch.setattr(jit, "load", lambda name: None)
    plain = decay_intra.cumulative(g[:, 1:], decay.FLOOR)
    assert compiled.dtype == plain.dtype == np.float64 and np.isnan(plain).any() and np.nanmin(plain) < -1000
    np.testing.assert_array_equal(compiled, plain)
