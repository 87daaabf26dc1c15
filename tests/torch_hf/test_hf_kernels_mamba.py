"""qkv.torch.hf_kernels' mamba_ssm and causal_conv1d functions against transformers' torch
fallbacks (the decorated functions run their torch path on a CPU without those packages):
outputs, final states and every gradient in float64 to 1e-9, float32 within twice the
fallback's own float32 error, packed sequences (seq_idx, cu_seqlens) equal to each sequence
alone, and refusals by name.

The fallbacks cast x, B, C and dt (and the gated norm its input) to float32 with ``.float()``
and ``.to(torch.float32)``; :func:`as64` makes those casts keep a float64 tensor float64, so
the same arithmetic runs in float64 (the oracle)."""
import contextlib
from unittest import mock

import pytest

torch = pytest.importorskip("torch", reason="qkv.torch needs PyTorch: pip install -e '.[torch]'")
pytest.importorskip("transformers", reason="the reference functions are transformers'")
from transformers.models.mamba import modeling_mamba as m1  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2 as m2  # noqa: E402

import qkv  # noqa: E402
from qkv import jit  # noqa: E402
from qkv.torch import hf_kernels as K  # noqa: E402
from qkv.torch.hf_kernels import conv as conv_module  # noqa: E402

F = torch.nn.functional
DT = torch.float64
_float, _to = torch.Tensor.float, torch.Tensor.to


def _to64(self, *args, **kwargs):
    if self.dtype == DT:
        args = tuple(DT if a is torch.float32 else a for a in args)
        kwargs = {k: DT if v is torch.float32 else v for k, v in kwargs.items()}
    return _to(self, *args, **kwargs)


@contextlib.contextmanager
def as64():
    """The fallbacks' casts to float32 keep float64 tensors float64 (float32 ones as they are);
    ``.float()`` returns a new tensor, as its cast does (a state updated in place after it)."""
    with mock.patch.object(torch.Tensor, "float", lambda self, *a, **k: self.clone() if self.dtype == DT else _float(self)), \
            mock.patch.object(torch.Tensor, "to", _to64):
        yield


def rand(*shape, seed=0, dtype=DT, grad=True, lo=None, hi=None):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=DT) if lo is None else lo + (hi - lo) * torch.rand(*shape, generator=g,
                                                                                                   dtype=DT)
    return t.to(dtype).requires_grad_(grad)


def weighted_loss(outs, seed=99):
    """Σ w · out over every output with fixed random weights w, so every output's gradient matters."""
    outs = outs if isinstance(outs, tuple) else (outs,)
    return sum((o * rand(*o.shape, seed=seed + i, dtype=o.dtype, grad=False)).sum() for i, o in enumerate(outs))


def grads(outs, inputs):
    return torch.autograd.grad(weighted_loss(outs), inputs, allow_unused=True)


def close(a, b, tol=1e-9):
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x is not None and y is not None and x.shape == y.shape, (x, y)
        gap, size = (x.detach() - y.detach()).abs().max().item(), y.detach().abs().max().item()
        assert gap <= tol * (1 + size), f"max |diff| {gap:.3g} against max |ref| {size:.3g}"


def err(x, ref):
    return (x.detach().double() - ref.detach()).abs().max().item()


# --- mamba_chunk_scan_combined --------------------------------------------------------------

def ssd_inputs(Bz=2, T=37, H=4, P=3, G=2, N=5, dtype=DT, seed=0):
    return dict(x=rand(Bz, T, H, P, seed=seed, dtype=dtype), dt=rand(Bz, T, H, seed=seed + 1, dtype=dtype),
                A=rand(H, seed=seed + 2, dtype=dtype, lo=-1.5, hi=-0.2), B=rand(Bz, T, G, N, seed=seed + 3, dtype=dtype),
                C=rand(Bz, T, G, N, seed=seed + 4, dtype=dtype), D=rand(H, seed=seed + 5, dtype=dtype),
                dt_bias=rand(H, seed=seed + 6, dtype=dtype), initial_states=rand(Bz, H, P, N, seed=seed + 7, dtype=dtype))


@pytest.mark.parametrize("T,G,chunk", [(1, 1, 8), (37, 2, 8), (64, 4, 16)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_scan_equals_fallback_float64(T, G, chunk, with_state):
    a = ssd_inputs(T=T, G=G)
    if not with_state:
        a.pop("initial_states")
    names = list(a)
    kw = dict(chunk_size=chunk, dt_softplus=True, dt_limit=(0.01, 2.0), return_final_states=True)
    with as64():
        ref = m2.mamba2_chunk_scan(*[a[n] for n in ("x", "dt", "A", "B", "C")], D=a["D"], dt_bias=a["dt_bias"],
                                   initial_states=a.get("initial_states"), **kw)
    out = K.mamba_chunk_scan_combined(*[a[n] for n in ("x", "dt", "A", "B", "C")], D=a["D"], dt_bias=a["dt_bias"],
                                      initial_states=a.get("initial_states"), **kw)
    assert out[0].dtype == DT and out[1].shape == ref[1].shape
    close(out, ref)
    close(grads(out, [a[n] for n in names]), grads(ref, [a[n] for n in names]))


def test_chunk_scan_z_gate_and_per_channel_D():
    """z (mamba_ssm's gate, which the fallback drops into **kwargs) and D (H, P): the fallback's
    scan without D, plus D x, times silu(z)."""
    a = ssd_inputs(T=19)
    D2, z = rand(4, 3, seed=20), rand(2, 19, 4, 3, seed=21)
    args = [a[n] for n in ("x", "dt", "A", "B", "C")]
    with as64():
        ref = (m2.mamba2_chunk_scan(*args, 8, dt_bias=a["dt_bias"], dt_softplus=True) + a["x"] * D2) * F.silu(z)
    out = K.mamba_chunk_scan_combined(*args, 8, D=D2, z=z, dt_bias=a["dt_bias"], dt_softplus=True)
    close(out, ref)
    leaves = args + [D2, z, a["dt_bias"]]
    close(grads(out, leaves), grads(ref, leaves))


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("terms", ["D and z", "D", "D (H, P) and z", "D (H, P)", "z", "neither"])
def test_chunk_scan_output_is_dense_with_each_term(terms, grad):
    """out is a dense (B, T, H, P) tensor, as mamba_ssm's (qkv computes (B, H, T, P): handed on
    transposed, the mixer's norm and products after it read it strided), with or without a
    gradient recorded, and the same numbers either way (D one a head or one a channel; z strided)."""
    a = ssd_inputs(T=19)
    D = (rand(4, 3, seed=20) if "(H, P)" in terms else rand(4, seed=20)) if "D" in terms else None
    z = (8 * rand(2, 19, 4, 9, seed=21))[..., 2:5] if "z" in terms else None   # a split's view, as the mixers'
    args = [a[n] for n in ("x", "dt", "A", "B", "C")]
    with torch.set_grad_enabled(grad):
        out = K.mamba_chunk_scan_combined(*args, 8, D=D, z=z, dt_bias=a["dt_bias"], dt_softplus=True)
    assert out.shape == (2, 19, 4, 3) and out.is_contiguous() and out.requires_grad == grad
    with torch.no_grad():
        other = K.mamba_chunk_scan_combined(*args, 8, D=D, z=z, dt_bias=a["dt_bias"], dt_softplus=True)
    assert torch.equal(out.detach(), other)


@pytest.mark.parametrize("trained", ["D", "z"])
def test_chunk_scan_gradient_of_D_or_z_alone(trained):
    """D or z the only input with a gradient (the scan's inputs frozen, as when only D is tuned):
    the result records it, and its gradient is the fallback's."""
    a = {n: t.detach() for n, t in ssd_inputs(T=19).items()}
    D = rand(4, seed=20, grad=trained == "D")
    z = rand(2, 19, 4, 3, seed=21, grad=trained == "z")
    args = [a[n] for n in ("x", "dt", "A", "B", "C")]
    out = K.mamba_chunk_scan_combined(*args, 8, D=D, z=z, dt_bias=a["dt_bias"], dt_softplus=True)
    with as64():
        ref = (m2.mamba2_chunk_scan(*args, 8, dt_bias=a["dt_bias"], dt_softplus=True) + a["x"] * D[:, None]) * F.silu(z)
    leaf = D if trained == "D" else z
    assert out.requires_grad
    close(out, ref)
    close(grads(out, [leaf]), grads(ref, [leaf]))


def test_chunk_scan_float32_within_twice_the_fallbacks_error():
    a = ssd_inputs(T=97, dtype=DT)
    args64 = [a[n].detach() for n in ("x", "dt", "A", "B", "C")]
    kw = dict(dt_softplus=True, return_final_states=True)
    with as64():
        ref = m2.mamba2_chunk_scan(*args64, 16, D=a["D"].detach(), dt_bias=a["dt_bias"].detach(), **kw)
    args32 = [t.float() for t in args64]
    fb = m2.mamba2_chunk_scan(*args32, 16, D=a["D"].detach().float(), dt_bias=a["dt_bias"].detach().float(), **kw)
    out = K.mamba_chunk_scan_combined(*args32, 16, D=a["D"].detach().float(), dt_bias=a["dt_bias"].detach().float(),
                                      **kw)
    assert out[0].dtype == torch.float32 and out[1].dtype == torch.float32
    for o, f, r in zip(out, fb, ref):
        assert err(o, r) <= 2 * err(f, r) + 1e-6


RUNS = [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]   # T = 31


def test_packed_sequences_equal_each_alone():
    """seq_idx (and the same cu_seqlens): each run computed alone (the first from initial_states),
    in outputs, the final state (the last run's), each run's state and every gradient."""
    T = len(RUNS)
    a = ssd_inputs(Bz=1, T=T)
    seq_idx = torch.tensor([RUNS], dtype=torch.int32)
    cuts = [0] + [t for t in range(1, T) if RUNS[t] != RUNS[t - 1]] + [T]
    cu = torch.tensor(cuts, dtype=torch.int32)
    leaves = list(a.values())
    kw = dict(D=a["D"], dt_bias=a["dt_bias"], dt_softplus=True)
    out, final, every = K.mamba_chunk_scan_combined(*[a[n] for n in ("x", "dt", "A", "B", "C")], 8, **kw,
                                                    initial_states=a["initial_states"], seq_idx=seq_idx,
                                                    cu_seqlens=cu, return_final_states=True, return_varlen_states=True)
    pieces, states = [], []
    with as64():
        for i, (s, e) in enumerate(zip(cuts[:-1], cuts[1:])):
            o, S = m2.mamba2_chunk_scan(*[a[n][:, s:e] for n in ("x", "dt", "B", "C")][:2], a["A"],
                                        *[a[n][:, s:e] for n in ("B", "C")], 8, **kw, return_final_states=True,
                                        initial_states=a["initial_states"] if i == 0 else None)
            pieces.append(o)
            states.append(S[0])
    ref = torch.cat(pieces, dim=1)
    close((out, final, every), (ref, states[-1][None], torch.stack(states)))
    close(grads((out, every), leaves), grads((ref, torch.stack(states)), leaves))
    with pytest.raises(ValueError, match="packed sequences"):   # why this module exists
        m2.mamba2_chunk_scan(*[a[n] for n in ("x", "dt", "A", "B", "C")], 8, seq_idx=seq_idx)
    # seq_idx alone, batch of two rows packed differently, equals cu_seqlens' answer row by row
    b2 = ssd_inputs(Bz=2, T=T, seed=3)
    ids = torch.tensor([RUNS, sorted(RUNS, key=lambda r: -r)], dtype=torch.int32)
    both = K.mamba_chunk_scan_combined(*[b2[n] for n in ("x", "dt", "A", "B", "C")], 8, seq_idx=ids, dt_softplus=True)
    for row in range(2):
        alone = K.mamba_chunk_scan_combined(*[b2[n][row:row + 1] for n in ("x", "dt")], b2["A"],
                                            *[b2[n][row:row + 1] for n in ("B", "C")], 8, seq_idx=ids[row:row + 1],
                                            dt_softplus=True)
        close(both[row:row + 1], alone)


# --- mamba_split_conv1d_scan_combined: the whole Mamba2Mixer in training ---------------------

def mixer(seed=0, dtype=DT):
    cfg = m2.Mamba2Config(hidden_size=16, num_heads=4, head_dim=8, expand=2, n_groups=2, state_size=5, conv_kernel=4,
                          chunk_size=8, num_hidden_layers=1, vocab_size=11, time_step_limit=(0.0, float("inf")))
    torch.manual_seed(seed)
    mod = m2.Mamba2Mixer(cfg, 0).to(dtype).train()
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(0.1 * torch.randn(p.shape, dtype=dtype))
    return mod


def split_call(mod, h, **kw):
    A = -torch.exp(mod.A_log.float() if mod.A_log.dtype != DT else mod.A_log)
    return K.mamba_split_conv1d_scan_combined(
        mod.in_proj(h), mod.conv1d.weight.squeeze(1), mod.conv1d.bias, mod.dt_bias, A, D=mod.D,
        chunk_size=mod.chunk_size, activation=mod.activation, rmsnorm_weight=mod.norm.weight,
        rmsnorm_eps=mod.norm.variance_epsilon, outproj_weight=mod.out_proj.weight, outproj_bias=mod.out_proj.bias,
        headdim=mod.head_dim, ngroups=mod.n_groups, norm_before_gate=False, return_final_states=False,
        dt_limit=mod.time_step_limit, **kw)


@pytest.mark.parametrize("T", [1, 29])
def test_split_conv1d_scan_equals_the_mixers_fallback_float64(T):
    mod = mixer()
    h = rand(2, T, 16, seed=5)
    leaves = [h] + list(mod.parameters())
    with as64():
        ref = mod(h)
    out = split_call(mod, h)
    close(out, ref)
    close(grads(out, leaves), grads(ref, leaves))


def test_split_conv1d_scan_float32_and_packed():
    mod64, mod32 = mixer(), mixer(dtype=torch.float32)
    mod32.load_state_dict({k: v.float() for k, v in mod64.state_dict().items()})
    h = rand(2, 41, 16, seed=6, grad=False)
    h32 = h.float()
    with torch.no_grad():
        with as64():
            ref = mod64(h)
        fb, out = mod32(h32), split_call(mod32, h32)
    assert err(out, ref) <= 2 * err(fb, ref) + 1e-6
    ids = torch.tensor([[0] * 13 + [1] * 28], dtype=torch.int32)
    h1 = rand(1, 41, 16, seed=7)
    packed = split_call(mod64, h1, seq_idx=ids)
    alone = torch.cat([split_call(mod64, h1[:, :13]), split_call(mod64, h1[:, 13:])], dim=1)
    close(packed, alone)
    close(grads(packed, [h1]), grads(alone, [h1]))


def test_split_conv1d_norm_before_gate_no_norm_and_mlp_part():
    """norm_before_gate=True, no rmsnorm (the scan's z gate) and a d_mlp part, against the
    pieces composed by hand from this module's own checked functions."""
    H, P, G, N, Kw, dmlp = 2, 3, 1, 4, 3, 2
    dim = H * P
    zx = rand(1, 9, 2 * dmlp + 2 * dim + 2 * G * N + H, seed=8)
    w, cb, db, A, D = rand(dim + 2 * G * N, Kw, seed=9), rand(dim + 2 * G * N, seed=10), rand(H, seed=11), \
        rand(H, seed=12, lo=-1.0, hi=-0.1), rand(H, P, seed=13)
    rw, ow = rand(dim, seed=14), rand(5, dmlp + dim, seed=15)
    x01, z, xBC, dt = torch.split(zx, [2 * dmlp, dim, dim + 2 * G * N, H], dim=-1)
    xBC = F.silu(F.conv1d(F.pad(xBC.transpose(1, 2), (Kw - 1, 0)), w[:, None], cb, groups=w.shape[0])).transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, G * N, G * N], dim=-1)
    y = K.mamba_chunk_scan_combined(x.unflatten(-1, (H, P)), dt, A, B.unflatten(-1, (G, N)), C.unflatten(-1, (G, N)),
                                    4, D=D, dt_bias=db, dt_softplus=True).flatten(-2)
    normed = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * rw * F.silu(z)
    mlp = F.silu(x01[..., :dmlp]) * x01[..., dmlp:]
    ref = F.linear(torch.cat([mlp, normed], -1), ow)
    out = K.mamba_split_conv1d_scan_combined(zx, w, cb, db, A, D, 4, rmsnorm_weight=rw, rmsnorm_eps=1e-5,
                                             outproj_weight=ow, norm_before_gate=True)
    close(out, ref)
    gated = K.mamba_split_conv1d_scan_combined(zx[..., 2 * dmlp:], w, cb, db, A, D, 4)   # no norm: y · silu(z)
    close(gated, y * F.silu(z))


# --- selective_state_update -----------------------------------------------------------------

def test_state_update_mamba2_shapes_equal_fallback():
    """As mamba2_scan_forward calls it: dt, D, dt_bias expanded over P, A over (P, N)."""
    Bz, H, P, G, N = 3, 4, 2, 2, 5
    s = rand(Bz, H, P, N, seed=1, grad=False)
    x, dt, B, C = rand(Bz, H, P, seed=2), \
        rand(Bz, H, seed=3)[..., None].expand(-1, -1, P), rand(Bz, G, N, seed=4), rand(Bz, G, N, seed=5)
    A = rand(H, seed=6, lo=-2.0, hi=-0.1)[:, None, None].expand(-1, P, N)
    D, db = rand(H, seed=7)[:, None].expand(-1, P), rand(H, seed=8)[:, None].expand(-1, P)
    z = rand(Bz, H, P, seed=9)
    s_ref, s_ours = s.clone(), s.clone()
    with as64():
        ref = m2.mamba2_selective_state_update(s_ref, x, dt, A, B, C, D, z=z, dt_bias=db, dt_softplus=True)
    out = K.selective_state_update(s_ours, x, dt, A, B, C, D, z=z, dt_bias=db, dt_softplus=True)
    close((out, s_ours), (ref, s_ref))
    leaves = [x, B, C, z]
    close(grads(out, leaves), grads(ref, leaves))
    big = torch.zeros(5, H, P, N, dtype=DT)   # state_batch_indices: rows 4, 0, 2 of a larger state
    big[[4, 0, 2]] = s
    out2 = K.selective_state_update(big, x.detach(), dt.detach(), A, B.detach(), C.detach(), D, z=z.detach(),
                                    dt_bias=db, dt_softplus=True, state_batch_indices=torch.tensor([4, 0, 2]))
    close((out2, big[[4, 0, 2]]), (ref, s_ref))
    assert big[[1, 3]].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_state_update_expanded_per_head_inputs_give_the_dense_bits(dtype):
    """dt, dt_bias and A expanded over P and N (transformers' Mamba-2 decoding step), whose decay is made once a
    head: the same bits as the same numbers laid out densely, state and output, and the same gradients of the
    one-a-head tensors (float32 at 30x: decays of e^-30 and more)."""
    Bz, H, P, G, N = 2, 4, 8, 1, 16
    s = rand(Bz, H, P, N, seed=1, grad=False, dtype=dtype)
    x, B, C, z = (rand(*shape, seed=i, dtype=dtype) for i, shape in enumerate([(Bz, H, P), (Bz, G, N), (Bz, G, N),
                                                                                (Bz, H, P)], 2))
    dt_h, db_h = 30 * rand(Bz, H, seed=6, dtype=dtype), rand(H, seed=7, dtype=dtype)
    A_h = rand(H, seed=8, lo=-2.0, hi=-0.1, dtype=dtype)
    D = rand(H, seed=9, dtype=dtype)[:, None].expand(-1, P)
    wide = (dt_h[..., None].expand(-1, -1, P), A_h[:, None, None].expand(-1, P, N), db_h[:, None].expand(-1, P))
    runs = []
    for dt, A, db in (wide, tuple(t.contiguous() for t in wide)):
        st = s.clone()
        out = K.selective_state_update(st, x, dt, A, B, C, D, z=z, dt_bias=db, dt_softplus=True)
        runs.append((out, st, grads(out, [dt_h, A_h, db_h, x, B])))
    (o1, s1, g1), (o2, s2, g2) = runs
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    close(g1, g2, tol=1e-6 if dtype == torch.float32 else 1e-12)


def test_state_update_mamba1_shapes_equal_fallback():
    Bz, Dd, N = 2, 6, 4
    s = rand(Bz, Dd, N, seed=1, grad=False)
    x, dt, z = rand(Bz, Dd, seed=2), rand(Bz, Dd, seed=3), rand(Bz, Dd, seed=4)
    A, B, C, D, db = rand(Dd, N, seed=5, lo=-2.0, hi=-0.1), rand(Bz, N, seed=6), rand(Bz, N, seed=7), \
        rand(Dd, seed=8), rand(Dd, seed=9)
    s_ref, s_ours = s.clone(), s.clone()
    with as64():
        ref = m1.mamba_selective_state_update(s_ref, x, dt, A, B, C, D, z=z, dt_bias=db, dt_softplus=True)
    out = K.selective_state_update(s_ours, x, dt, A, B, C, D, z=z, dt_bias=db, dt_softplus=True)
    close((out, s_ours), (ref, s_ref))
    leaves = [x, dt, A, B, C, D, z, db]
    close(grads(out, leaves), grads(ref, leaves))


# --- selective_scan_fn (Mamba-1) ------------------------------------------------------------

def scan_inputs(Bz=2, Dd=6, N=4, T=23, dtype=DT):
    return dict(u=rand(Bz, Dd, T, seed=1, dtype=dtype), delta=rand(Bz, Dd, T, seed=2, dtype=dtype),
                A=rand(Dd, N, seed=3, lo=-2.0, hi=-0.1, dtype=dtype), B=rand(Bz, N, T, seed=4, dtype=dtype),
                C=rand(Bz, N, T, seed=5, dtype=dtype), D=rand(Dd, seed=6, dtype=dtype),
                z=rand(Bz, Dd, T, seed=7, dtype=dtype), delta_bias=rand(Dd, seed=8, dtype=dtype))


def fallback_args(a):
    """The fallback names u, delta hidden_states, dt: positional, in mamba_ssm's order."""
    return [a[n] for n in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")]


@pytest.mark.parametrize("T", [1, 23])
def test_selective_scan_equals_fallback_float64(T):
    a = scan_inputs(T=T)
    with as64():
        ref = m1.mamba_selective_scan(*fallback_args(a), delta_softplus=True, return_last_state=True)
    out = K.selective_scan_fn(**a, delta_softplus=True, return_last_state=True)
    close(out, ref)
    leaves = list(a.values())
    close(grads(out, leaves), grads(ref, leaves))


def test_selective_scan_float32_and_b_c_layouts():
    a = {k: v.detach() for k, v in scan_inputs(T=97).items()}
    with as64():
        ref = m1.mamba_selective_scan(*fallback_args(a), delta_softplus=True)
    a32 = {k: v.float() for k, v in a.items()}
    fb, out = m1.mamba_selective_scan(*fallback_args(a32), delta_softplus=True), K.selective_scan_fn(**a32, delta_softplus=True)
    assert out.dtype == torch.float32 and err(out, ref) <= 2 * err(fb, ref) + 1e-6
    # (B, G, N, T) per group of channels, and (D, N) time-invariant, as their expansions
    Bg, Cg = rand(2, 3, 4, 23, seed=30), rand(2, 3, 4, 23, seed=31)
    b = {k: v for k, v in scan_inputs().items() if k not in ("B", "C")}
    b["delta_softplus"] = True
    grouped = K.selective_scan_fn(**b, B=Bg, C=Cg)
    by_channel = [K.selective_scan_fn(b["u"][:, d:d + 1], b["delta"][:, d:d + 1], b["A"][d:d + 1], Bg[:, d // 2],
                                      Cg[:, d // 2], D=b["D"][d:d + 1], z=b["z"][:, d:d + 1],
                                      delta_bias=b["delta_bias"][d:d + 1], delta_softplus=True) for d in range(6)]
    close(grouped, torch.cat(by_channel, dim=1))
    Bi, Ci = rand(6, 4, seed=32), rand(6, 4, seed=33)
    lti = K.selective_scan_fn(**b, B=Bi, C=Ci)
    rows = [K.selective_scan_fn(b["u"][:, d:d + 1], b["delta"][:, d:d + 1], b["A"][d:d + 1],
                                Bi[d][None, :, None].expand(2, 4, 23), Ci[d][None, :, None].expand(2, 4, 23),
                                D=b["D"][d:d + 1], z=b["z"][:, d:d + 1], delta_bias=b["delta_bias"][d:d + 1],
                                delta_softplus=True) for d in range(6)]
    close(lti, torch.cat(rows, dim=1))


# --- causal_conv1d --------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "channel_last", "split"])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("T,Kw", [(1, 4), (17, 4), (9, 2)])
def test_conv_fn_equals_fallback(activation, T, Kw, layout):
    """Either layout of x (channel-last: a (B, T, D) tensor transposed, as transformers' layers
    hand it over and causal_conv1d takes it; split: channels of a wider (B, T, W) projection,
    the Mamba-2 mixers' xBC); the output keeps x's layout (dense), as causal_conv1d's."""
    if layout == "split":
        x = rand(2, T, 9, seed=1)[..., 2:7].transpose(1, 2)            # rows 9 apart, channels contiguous
    else:
        x = rand(2, 5, T, seed=1) if layout == "contiguous" else rand(2, T, 5, seed=1).transpose(1, 2)
    w, b = rand(5, Kw, seed=2), rand(5, seed=3)
    ref = m2.causal_conv1d_fn(x, w, b, activation=activation)
    out = K.causal_conv1d_fn(x, w, b, activation=activation)
    assert out.shape == x.shape and out.stride() == torch.empty_like(x).stride()
    close(out, ref)
    close(grads(out, [x, w, b]), grads(ref, [x, w, b]))
    # initial states = the inputs before t = 0; final states = the last K - 1 inputs
    s0 = rand(2, 5, Kw - 1, seed=4)
    o2, fin = K.causal_conv1d_fn(x, w, b, initial_states=s0, return_final_states=True, activation=activation)
    whole = m2.causal_conv1d_fn(torch.cat([s0, x], -1), w, b, activation=activation)[..., Kw - 1:]
    close((o2, fin), (whole, torch.cat([s0, x], -1)[..., T:]))
    buf = torch.empty(2, 5, Kw - 1, dtype=DT)
    assert K.causal_conv1d_fn(x, w, b, return_final_states=True, final_states_out=buf)[1] is buf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_fn_split_input_has_the_bits_of_its_dense_copy(dtype):
    """A split of a wider projection (channels contiguous, time steps W apart) is taken channel-last:
    the bits of its dense channel-last copy, outputs, final states and every gradient."""
    g = torch.Generator().manual_seed(5)
    wide, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((2, 33, 19), (6, 4), (6,)))
    s0 = torch.randn(2, 6, 3, generator=g).to(dtype)
    runs = []
    for dense in (False, True):
        src = wide.clone().requires_grad_()
        x = src[..., 4:10].transpose(1, 2)                                # (B, D, T), rows 19 apart
        x = x.contiguous().transpose(1, 2).contiguous().transpose(1, 2) if dense else x
        assert x.stride(1) == 1
        wg, bg, sg = (t.clone().requires_grad_() for t in (w, b, s0))
        out, fin = K.causal_conv1d_fn(x, wg, bg, initial_states=sg, return_final_states=True, activation="silu")
        assert out.stride() == (33 * 6, 1, 6)                             # dense channel-last, as causal_conv1d's
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(dtype)
        runs.append([out, fin, *torch.autograd.grad((out * dy).sum(), [src, wg, bg, sg])])
    for a, c in zip(*runs):
        assert torch.equal(a, c)


def test_conv_fn_packed_equals_each_alone():
    ids = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 2, 3, 3, 3]])
    x, w, b = rand(1, 3, 11, seed=1), rand(3, 4, seed=2), rand(3, seed=3)
    out = K.causal_conv1d_fn(x, w, b, seq_idx=ids, activation="swish")
    alone = torch.cat([m2.causal_conv1d_fn(x[..., s:e], w, b, activation="silu")
                       for s, e in ((0, 2), (2, 7), (7, 8), (8, 11))], -1)
    close(out, alone)
    close(grads(out, [x, w, b]), grads(alone, [x, w, b]))


@pytest.mark.parametrize("T", [1, 3])
def test_conv_update_equals_fallback_ring_and_indices(T):
    x, w, b = rand(2, 5, T, seed=1), rand(5, 4, seed=2), rand(5, seed=3)
    state = rand(2, 5, 6, seed=4, grad=False)    # L = 6 >= K - 1
    s_ref, s_ours = state.clone(), state.clone()
    ref = m2.causal_conv1d_update(x, s_ref, w, b, activation="silu")
    out = K.causal_conv1d_update(x, s_ours, w, b, activation="silu")
    close((out, s_ours), (ref, s_ref))
    close(grads(out, [x, w, b]), grads(ref, [x, w, b]))
    one = K.causal_conv1d_update(x[..., 0], state.clone(), w, b)               # (B, D): one step
    close(one, m2.causal_conv1d_update(x[..., :1], state.clone(), w, b)[..., 0])
    # a ring buffer rotated by cache_seqlens holds the same history: same outputs, same history after
    shift = torch.tensor([2, 5], dtype=torch.int32)
    ring = torch.stack([torch.roll(state[i], int(shift[i]), dims=-1) for i in range(2)])
    out_ring = K.causal_conv1d_update(x, ring, w, b, activation="silu", cache_seqlens=shift)
    back = torch.stack([torch.roll(ring[i], -int(shift[i] + T), dims=-1) for i in range(2)])
    close((out_ring, back), (ref, s_ref))
    big = torch.zeros(4, 5, 6, dtype=DT)
    big[[3, 1]] = state
    out_idx = K.causal_conv1d_update(x, big, w, b, activation="silu", conv_state_indices=torch.tensor([3, 1]))
    close((out_idx, big[[3, 1]]), (ref, s_ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["(B, D, T)", "(B, T, D) transposed"])
def test_conv_update_token_by_token_has_the_prefills_bits(dtype, layout):
    """Decoding T tokens one at a time from a zero state gives causal_conv1d_fn's outputs bit
    for bit: both sum the K taps in the same order (a generation's first tokens and its cached
    continuation round alike)."""
    g = torch.Generator().manual_seed(7)
    x, w, b = (torch.randn(*s, generator=g, dtype=dtype) for s in [(2, 48, 9), (48, 4), (48,)])
    xx = x if layout == "(B, D, T)" else x.transpose(1, 2).contiguous().transpose(1, 2)
    full = K.causal_conv1d_fn(xx, w, b, activation="silu")
    state = torch.zeros(2, 48, 3, dtype=dtype)
    steps = torch.stack([K.causal_conv1d_update(x[:, :, t], state, w, b, activation="silu") for t in range(9)], -1)
    assert torch.equal(full, steps)
    assert torch.equal(state, x[:, :, -3:])


@pytest.mark.parametrize("compiled,threads", [(True, 1), (True, 2), (False, 2)],
                         ids=["compiled, 1 thread", "compiled, 2 threads", "torch calls"])
@pytest.mark.parametrize("Bsz", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["(B, D, T)", "(B, T, D) transposed", "split", "split of (T, B, ·)"])
@pytest.mark.parametrize("Kw,D,T,states", [(4, 48, 300, True), (4, 37, 1000, False), (2, 19, 129, True),
                                           (3, 64, 4096, False)])
def test_conv_fn_without_a_gradient_has_the_bits_of_the_recorded_path(monkeypatch, request, dtype, layout, Kw, D, T,
                                                                      states, Bsz, compiled, threads):
    """Without a gradient (prefill, evaluation) a channel-last convolution runs a block of time steps at a
    time (the blocks small here: many of them, the last one short; one batch row: SiLU block by block,
    the blocks whole vectors of torch's loops, as D = 37 and 19 need), each block's taps one compiled call
    (conv_rows, reading a split in place) or, without the compiled module, torch's calls; on torch's 2
    threads the compiled taps in two calls, half the steps each on qkv's workers, SiLU over the slab;
    with a gradient recorded, torch's calls over whole slabs. The same bits, outputs and final states,
    with and without bias, activation and initial states."""
    monkeypatch.setattr(conv_module, "BLOCK", 2048)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    request.addfinalizer(lambda: torch.set_num_threads(before))
    calls, rows = [], []
    real = conv_module._blocked_taps
    monkeypatch.setattr(conv_module, "_blocked_taps", lambda *a: calls.append(1) or real(*a))
    fast = jit.load(jit.CONV)
    if compiled and fast is None:
        pytest.skip("qkv's compiled kernels are off here (QKV_JIT=0 or no numba)")
    if compiled:
        real_rows = fast.conv_rows
        monkeypatch.setattr(fast, "conv_rows", lambda *a: rows.append(a[-2]) or real_rows(*a))
    else:
        monkeypatch.setattr(conv_module.jit, "load", lambda name: None)
    g = torch.Generator().manual_seed(Kw + D + T)
    if layout == "split":
        x = torch.randn(Bsz, T, D + 7, generator=g, dtype=dtype)[..., 3:3 + D].transpose(1, 2)
    elif layout == "split of (T, B, ·)":                              # batch rows interleaved in time
        x = torch.randn(T, Bsz, D + 5, generator=g, dtype=dtype).transpose(0, 1)[..., 5:].transpose(1, 2)
    elif layout == "(B, D, T)":
        x = torch.randn(Bsz, D, T, generator=g, dtype=dtype)
    else:
        x = torch.randn(Bsz, T, D, generator=g, dtype=dtype).transpose(1, 2)
    x = x * 8                                                          # SiLU's scalar and vector bits differ more
    w, b = torch.randn(D, Kw, generator=g, dtype=dtype), torch.randn(D, generator=g, dtype=dtype)
    s0 = torch.randn(Bsz, D, Kw - 1, generator=g, dtype=dtype) if states else None
    for bias, activation in ((b, "silu"), (None, None), (b, None)):
        with torch.no_grad():
            fast = K.causal_conv1d_fn(x, w, bias, initial_states=s0, return_final_states=True, activation=activation)
        slow = K.causal_conv1d_fn(x, w.clone().requires_grad_(), bias, initial_states=s0, return_final_states=True,
                                  activation=activation)
        assert fast[0].stride() == slow[0].stride()
        for a, c in zip(fast, slow):
            assert torch.equal(a, c.detach())
    assert bool(calls) == (layout != "(B, D, T)")                   # the blocks ran (channel-last only)
    vector = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")   # else torch's addcmul_ is no FMA
    assert bool(rows) == (compiled and vector and layout != "(B, D, T)")
    if rows and threads == 2:                                         # two halves a call: T steps in all
        assert len(rows) == 2 * 3 and sum(rows) == 3 * T


def test_conv_blocks_align_without_shrinking():
    """A block is a whole number of ALIGN numbers (SiLU block by block) where that keeps at least
    half of its BLOCK numbers; an odd width past BLOCK / ALIGN keeps its rows (blocks of K rows
    would cost a dozen torch calls every K steps)."""
    for width in list(range(1, 300)) + list(range(300, 9000, 37)):
        rows, whole = conv_module._block_rows(width, 4), conv_module.BLOCK // width
        assert max(4, whole // 2) <= rows <= max(4, whole), width
        if rows > 4 and rows != whole:
            assert rows * width % conv_module.ALIGN == 0, width


# --- refusals by name -----------------------------------------------------------------------

def test_refusals_name_the_argument():
    a = {k: v.detach() for k, v in ssd_inputs(Bz=2, T=6).items()}
    args = [a[n] for n in ("x", "dt", "A", "B", "C")]
    cases = [
        (lambda: K.causal_conv1d_fn(args[0][..., 0], rand(6, 4), activation="gelu"), "activation"),
        (lambda: K.causal_conv1d_fn(rand(1, 3, 5), rand(3, 4), seq_idx=torch.zeros(1, 5, dtype=torch.int32),
                                    initial_states=rand(1, 3, 3)), "seq_idx"),
        (lambda: K.causal_conv1d_fn(rand(1, 3, 5), rand(3, 4), final_states_out=rand(1, 3, 3)), "final_states_out"),
        (lambda: K.causal_conv1d_fn(rand(1, 3, 5), rand(4, 4)), "weight"),
        (lambda: K.causal_conv1d_update(rand(1, 3), rand(1, 3, 2), rand(3, 4)), "conv_state"),
        (lambda: K.mamba_chunk_scan_combined(*args, 8, return_varlen_states=True), "cu_seqlens"),
        (lambda: K.mamba_chunk_scan_combined(*args, 8, cu_seqlens=torch.tensor([0, 3, 6])), "cu_seqlens"),
        (lambda: K.mamba_chunk_scan_combined(*[t[:1] for t in args[:2]], args[2], *[t[:1] for t in args[3:]], 8,
                                             seq_idx=torch.tensor([[0, 0, 1, 1, 1, 1]]),
                                             cu_seqlens=torch.tensor([0, 3, 6])), "seq_idx and cu_seqlens"),
        (lambda: K.mamba_chunk_scan_combined(*args, 0), "chunk_size"),
        (lambda: K.mamba_chunk_scan_combined(*args, 8, dt_limit=(1.0,)), "dt_limit"),
        (lambda: K.mamba_chunk_scan_combined(*args[:3], args[3][:, :, :1].expand(-1, -1, 3, -1), args[4], 8), "B"),
        (lambda: K.mamba_chunk_scan_combined(*args, 8, D=rand(3)), "D"),
        (lambda: K.mamba_split_conv1d_scan_combined(rand(1, 4, 40), rand(12, 4), None, rand(4), rand(4), rand(4), 8),
         "headdim"),
        (lambda: K.selective_scan_fn(rand(1, 2, 3), rand(1, 2, 3), rand(2, 4).to(torch.complex128), rand(1, 4, 3),
                                     rand(1, 4, 3)), "A must be real"),
        (lambda: K.selective_scan_fn(rand(1, 2, 3), rand(1, 2, 3), rand(2, 4), rand(1, 5, 3), rand(1, 4, 3)), "B"),
        (lambda: K.selective_state_update(rand(2, 3, 4), rand(2, 3), rand(2, 3), rand(3, 4), rand(2, 4), rand(2, 4),
                                          state_batch_indices=torch.tensor([0, 7])), "state_batch_indices"),
    ]
    for call, name in cases:
        with pytest.raises(qkv.ShapeError, match=name):
            call()
    with pytest.raises(qkv.ShapeError, match=r"dt · A \(.*\) must be finite and <= 0"):   # A > 0 grows the state
        K.mamba_chunk_scan_combined(args[0], args[1], -args[2], *args[3:], 8, dt_softplus=True)
    with pytest.raises(qkv.ShapeError, match=r"delta · A \(.*\) must be finite and <= 0"):   # Δ < 0 without softplus
        K.selective_scan_fn(rand(1, 2, 3), -rand(1, 2, 3, lo=0.1, hi=1.0), rand(2, 4, lo=-1.0, hi=-0.1),
                            rand(1, 4, 3), rand(1, 4, 3))


# --- a whole transformers Mamba2Model with its kernel names bound to qkv's ------------------

@pytest.mark.slow
def test_whole_mamba2_model_on_these_kernels():
    """transformers' Mamba2Model with the module's replaceable names bound to these functions:
    packed sequences (seq_idx through the model's kwargs) equal each sequence alone; training
    (the fused split call) equals the float64 fallback model in output and every parameter's
    gradient; prefill then one cached decoding step (selective_state_update,
    causal_conv1d_update) equals the full forward's last row."""
    cfg = m2.Mamba2Config(hidden_size=16, num_heads=4, head_dim=8, expand=2, n_groups=2, state_size=5, conv_kernel=4,
                          chunk_size=8, num_hidden_layers=2, vocab_size=11)
    torch.manual_seed(0)
    model = m2.Mamba2Model(cfg).to(DT)
    ids = torch.randint(0, 11, (1, 20), generator=torch.Generator().manual_seed(1))
    names = dict(mamba2_chunk_scan=K.mamba_chunk_scan_combined, causal_conv1d_fn=K.causal_conv1d_fn,
                 causal_conv1d_update=K.causal_conv1d_update, mamba2_selective_state_update=K.selective_state_update,
                 mamba2_split_conv1d_scan_combined=K.mamba_split_conv1d_scan_combined)
    params = list(model.parameters())
    with as64():
        ref = model.train()(ids, use_cache=False).last_hidden_state     # the fallback: unfused, in float64
    with contextlib.ExitStack() as stack:   # as64: the model's own A_log.float() kept float64 as for ref
        stack.enter_context(as64())
        for name, fn in names.items():
            stack.enter_context(mock.patch.object(m2, name, fn))
        out = model(ids, use_cache=False).last_hidden_state
        close(out, ref)
        close(grads(out, params), grads(ref, params))
        model.eval()
        with torch.no_grad():
            seq_idx = torch.tensor([[0] * 7 + [1] * 13], dtype=torch.int32)
            packed = model(ids, seq_idx=seq_idx, use_cache=False).last_hidden_state
            alone = torch.cat([model(ids[:, :7], use_cache=False).last_hidden_state,
                               model(ids[:, 7:], use_cache=False).last_hidden_state], dim=1)
            close(packed, alone)
            full = model(ids, use_cache=False).last_hidden_state
            pre = model(ids[:, :19], use_cache=True)
            step = model(ids[:, 19:], cache=pre.cache, use_cache=True).last_hidden_state
            close(step, full[:, 19:])
