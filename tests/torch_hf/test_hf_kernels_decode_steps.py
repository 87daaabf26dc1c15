"""The decoding steps without a gradient in one compiled pass (``selective_state_update`` on
``qkv.recurrent.scan.compiled.selective_step``) against the same functions' torch steps (the
compiled passes off) and a float64 oracle: the state's bits equal, the output within its
float32 rounding, in the layouts transformers hands over (Mamba-2's per-head dt, A, D expanded
over P and N; Mamba-1's channels), a state in any layout, several groups, D and the gate."""
import pytest

torch = pytest.importorskip("torch", reason="qkv.torch needs PyTorch: pip install -e '.[torch]'")

from qkv import jit  # noqa: E402
from qkv.torch import hf_kernels as K  # noqa: E402

if not jit.enabled() or jit.load(jit.SCAN) is None:
    pytest.skip("numba (the fast extra) is not installed, or QKV_JIT=0", allow_module_level=True)


def _rand(*shape, seed, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _mamba2(Bz, H, P, N, G, per_head, gate, skip):
    """transformers' Mamba-2 decoding step's arguments (float64; cast by the caller)."""
    dt_h, db_h = _rand(Bz, H, seed=1, scale=3.0), _rand(H, seed=2)
    A_h = -torch.exp(_rand(H, seed=3, scale=1.5))                          # decays down to about e^-30 a step
    D_h = _rand(H, seed=4)
    if per_head:
        dt, A = dt_h[..., None].expand(-1, -1, P), A_h[:, None, None].expand(-1, P, N)
        D, db = D_h[:, None].expand(-1, P), db_h[:, None].expand(-1, P)
    else:
        dt, A = _rand(Bz, H, P, seed=5, scale=3.0), -torch.exp(_rand(H, P, N, seed=6, scale=1.5))
        D, db = _rand(H, P, seed=7), _rand(H, P, seed=8)
    return dict(x=_rand(Bz, H, P, seed=9, scale=30.0), dt=dt, A=A, B=_rand(Bz, G, N, seed=10),
                C=_rand(Bz, G, N, seed=11), D=D if skip else None, z=_rand(Bz, H, P, seed=12) if gate else None,
                dt_bias=db, dt_softplus=True), _rand(Bz, H, P, N, seed=13, scale=5.0)


def _mamba1(Bz, Dd, N, gate, skip):
    return dict(x=_rand(Bz, Dd, seed=1, scale=30.0), dt=_rand(Bz, Dd, seed=2), A=-torch.exp(_rand(Dd, N, seed=3)),
                B=_rand(Bz, N, seed=4), C=_rand(Bz, N, seed=5), D=_rand(Dd, seed=6) if skip else None,
                z=_rand(Bz, Dd, seed=7) if gate else None, dt_bias=_rand(Dd, seed=8), dt_softplus=True), \
        _rand(Bz, Dd, N, seed=9, scale=5.0)


def _step(args, state, dtype, layout):
    """``(out, state after)`` of one step, the state laid out ``layout`` ("c" or "t": its last two
    axes transposed in memory) and updated in place."""
    st = state.to(dtype, copy=True)                                        # (stepped in place)
    if layout == "t":
        st = st.transpose(-1, -2).contiguous().transpose(-1, -2)
    cast = {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with torch.no_grad():
        out = K.selective_state_update(st, **cast)
    return out, st


CASES = {"mamba2 per head": lambda: _mamba2(2, 4, 8, 16, 1, True, False, True),
         "mamba2 dense, 2 groups, gated": lambda: _mamba2(1, 4, 8, 16, 2, False, True, True),
         "mamba2 no D, odd N": lambda: _mamba2(3, 2, 5, 13, 2, True, True, False),
         "mamba1 gated": lambda: _mamba1(2, 12, 16, True, True),
         "mamba1 plain": lambda: _mamba1(1, 7, 5, False, False)}


@pytest.mark.parametrize("layout", ["c", "t"], ids=["state C-ordered", "state transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_state_step_against_the_torch_step_and_float64(monkeypatch, case, dtype, layout):
    args, state = CASES[case]()
    fast, calls = jit.load(jit.SCAN), []
    real = fast.selective_step
    monkeypatch.setattr(fast, "selective_step", lambda *a: calls.append(1) or real(*a))
    out, st = _step(args, state, dtype, layout)
    assert calls, "the compiled step did not run"
    assert out.dtype == dtype and st.stride() == _step(args, state, dtype, layout)[1].stride()
    monkeypatch.setattr(jit, "load", lambda name: None)
    ref_out, ref_st = _step(args, state, dtype, layout)                    # the torch step
    assert torch.equal(st, ref_st), "the state: not the torch step's bits"
    assert torch.isfinite(out).all()
    exact = _read(st, {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    scale = exact.abs().max()
    err, ref_err = ((o.double() - exact).abs().max() / scale for o in (out, ref_out))
    if dtype == torch.float64:
        assert err < 1e-13, err
    else:                                       # the read of the same state: Σ_n in float64, no worse than torch's
        assert err <= max(ref_err, 2 ** -23), (err, ref_err)


def _read(st, args):
    """The output the stepped state ``st`` gives, in float64 from the inputs as they came (one
    rounding of the whole read away: the paths differ there only)."""
    x, C, D, z = (None if args[k] is None else args[k].double() for k in ("x", "C", "D", "z"))
    s = st.double()
    if x.dim() == 2:                                                       # Mamba-1: (B, D, N), C (B, N)
        y = (s * C[:, None, :]).sum(-1)
    else:                                                                  # Mamba-2: (B, H, P, N), C (B, G, N)
        y = (s * C.repeat_interleave(s.shape[1] // C.shape[1], dim=1)[:, :, None, :]).sum(-1)
    if D is not None:
        y = y + x * D
    return y if z is None else y * torch.nn.functional.silu(z)


def test_a_step_with_a_gradient_or_state_rows_stays_on_torch(monkeypatch):
    """Where a gradient is recorded, or state_batch_indices picks the rows, the torch step runs
    (the compiled one is not called), with the same state bits as the compiled step elsewhere."""
    args, state = CASES["mamba2 per head"]()
    fast, calls = jit.load(jit.SCAN), []
    real = fast.selective_step
    monkeypatch.setattr(fast, "selective_step", lambda *a: calls.append(1) or real(*a))
    x = args["x"].float().requires_grad_()
    st = state.float()
    out = K.selective_state_update(st, **{**{k: v.float() if isinstance(v, torch.Tensor) else v
                                             for k, v in args.items()}, "x": x})
    out.sum().backward()
    big = torch.zeros((5,) + state.shape[1:])
    big[[3, 1]] = state.float()
    with torch.no_grad():
        K.selective_state_update(big, **{k: v.float() if isinstance(v, torch.Tensor) else v for k, v in args.items()},
                                 state_batch_indices=torch.tensor([3, 1]))
    assert not calls and x.grad is not None
    _, fast_st = _step(args, state, torch.float32, "c")
    assert torch.equal(big[[3, 1]], fast_st) and torch.equal(st, fast_st)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("T, L, D, bias, act", [(1, 3, 2176, True, "silu"), (1, 3, 37, False, None),
                                                 (3, 6, 48, True, "silu"), (2, 5, 19, False, "silu")])
@pytest.mark.parametrize("layout", ["c", "t"], ids=["C-ordered", "strided"])
def test_compiled_conv_update_gives_the_torch_steps_bits(monkeypatch, dtype, T, L, D, bias, act, layout):
    """causal_conv1d_update without a gradient in one compiled pass: the output and the shifted
    state bit for bit those of torch's steps (the first tap a product, each later an FMA, the
    bias after), x at 30x, a state and an x in strided layouts (the mixers' split views)."""
    g = torch.Generator().manual_seed(T * 100 + D)
    x = 30 * torch.randn(2, T, D, generator=g, dtype=dtype).transpose(1, 2)     # (B, D, T), strided
    if layout == "c":
        x = x.contiguous()
    w, b = torch.randn(D, 4, generator=g, dtype=dtype), torch.randn(D, generator=g, dtype=dtype) if bias else None
    state = torch.randn(2, D, L, generator=g, dtype=dtype)
    if layout == "t":
        state = state.transpose(1, 2).contiguous().transpose(1, 2)
    fast, calls = jit.load(jit.CONV), []
    real = fast.conv_step
    monkeypatch.setattr(fast, "conv_step", lambda *a: calls.append(1) or real(*a))
    runs = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(jit, "load", lambda name: None)
        st = state.clone()
        with torch.no_grad():
            out = K.causal_conv1d_update(x[..., 0] if T == 1 else x, st, w, b, activation=act)
        runs.append((out, st))
    vector = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")   # else torch's addcmul_ is no FMA
    assert calls == ([1] if vector else [])
    (o1, s1), (o2, s2) = runs
    assert o1.shape == o2.shape and torch.equal(o1, o2) and torch.equal(s1, s2) and s1.stride() == state.stride()
    assert torch.equal(s1[..., -T:], x if T > 1 else x[..., :1])


def test_compiled_steps_against_transformers_fallbacks_in_float64():
    """The compiled steps (no gradient) against transformers' own torch steps, run in float64
    (recurrent_hf.float64): Mamba-2's as its mixer calls it (dt, A, D expanded, 2 groups, a gate),
    Mamba-1's, and the convolution's, to 1e-14 of the largest entry, states included."""
    from recurrent_hf import float64
    from transformers.models.mamba import modeling_mamba as m1
    from transformers.models.mamba2 import modeling_mamba2 as m2

    (a2, s2), (a1, s1) = _mamba2(2, 8, 16, 32, 2, True, True, True), _mamba1(2, 24, 16, True, True)
    for args, state, ref in ((a2, s2, m2.mamba2_selective_state_update), (a1, s1, m1.mamba_selective_state_update)):
        ours, theirs = state.clone(), state.clone()
        with torch.no_grad():
            out = K.selective_state_update(ours, **args)
            with float64([m1]):
                want = ref(theirs, *(args[k] for k in ("x", "dt", "A", "B", "C", "D")), z=args["z"],
                           dt_bias=args["dt_bias"], dt_softplus=True)
        assert out.dtype == torch.float64
        for got, exp in ((out, want), (ours, theirs)):
            assert (got - exp).abs().max() <= 1e-14 * exp.abs().max()
    g = torch.Generator().manual_seed(5)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64) for s in [(2, 40, 1), (40, 4), (40,)])
    ours, theirs = (torch.randn(2, 40, 3, generator=g, dtype=torch.float64) for _ in range(2))
    theirs.copy_(ours)
    with torch.no_grad():
        out = K.causal_conv1d_update(30 * x[..., 0], ours, w, b, activation="silu")
        want = m2.causal_conv1d_update(30 * x, theirs, w, b, activation="silu")[..., 0]
    assert (out - want).abs().max() <= 1e-14 * want.abs().max() and torch.equal(ours, theirs)


def test_a_nan_in_one_state_row_reaches_that_row_alone():
    """The compiled steps with a NaN in one (batch, head, channel) of the state: that channel's
    output and state are NaN, every other number finite and as without it."""
    args, state = CASES["mamba2 dense, 2 groups, gated"]()
    args = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    clean, bad = state.float(), state.float().clone()
    bad[0, 3, 2, 5] = float("nan")
    with torch.no_grad():
        o_clean, o_bad = K.selective_state_update(clean, **args), K.selective_state_update(bad, **args)
    hit = torch.zeros_like(o_bad, dtype=torch.bool)
    hit[0, 3, 2] = True
    assert torch.isnan(o_bad[hit]).all() and torch.equal(o_bad[~hit], o_clean[~hit])
    assert torch.isnan(bad[0, 3, 2, 5]) and torch.equal(bad[~torch.isnan(bad)], clean[~torch.isnan(bad)])
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(2, 40, generator=g), torch.randn(40, 4, generator=g)
    st = torch.randn(2, 40, 3, generator=g)
    st_bad = st.clone()
    st_bad[1, 7, 1] = float("nan")
    with torch.no_grad():
        o, o_bad = K.causal_conv1d_update(x, st, w, activation="silu"), K.causal_conv1d_update(x, st_bad, w, activation="silu")
    assert torch.isnan(o_bad[1, 7]) and torch.isnan(o_bad).sum() == 1 and torch.equal(o_bad[0], o[0])
    assert torch.isnan(st_bad[1, 7, 0]) and torch.isnan(st_bad).sum() == 1            # shifted one step back
