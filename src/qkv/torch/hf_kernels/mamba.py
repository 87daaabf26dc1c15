"""mamba_ssm's Mamba-2 kernels on qkv's recurrences: ``mamba_chunk_scan_combined`` and
``mamba_split_conv1d_scan_combined`` under the package's names and signatures, as
transformers' Mamba-2, Bamba, Zamba2, FalconH1, NemotronH and GraniteMoeHybrid call them,
differentiable through autograd (:func:`qkv.torch.decay_attention`'s operator).

**SSD is decay_attention.** Per head h, with ``Δ_t = dt_limit-clamped softplus(dt_t +
dt_bias)`` and the state ``S (P, N)``::

    S_t = exp(Δ_t A_h) S_{t-1} + (Δ_t x_t) B_tᵀ          x_t (P,), B_t, C_t (N,)
    y_t = S_t C_t + D_h x_t,      out_t = y_t · silu(z_t)   (z optional)

which is :func:`qkv.torch.decay_attention` with ``log_decay = Δ A`` (one decay a head),
``k = B``, ``q = C``, ``v = Δ x``, ``scale = 1`` and qkv's state ``(N, P)`` the transpose of
mamba_ssm's ``(P, N)``; B and C of group g serve heads ``g·H/G .. (g+1)·H/G - 1``. qkv picks
its own chunk (``chunk_size`` is checked and does not change the result).

**Packed sequences.** ``seq_idx (B, T)``: the state is reset where the id changes, so each
run of one id is computed as if alone (mamba_ssm's rule); ``initial_states`` is the first
run's start state. ``cu_seqlens (S + 1,)`` (batch 1) marks the same boundaries and resets
there too (mamba_ssm itself resets only at ``seq_idx``; where both are given they must
agree); ``return_varlen_states`` returns each sequence's final state ``(S, H, P, N)``.

Compute in float32 (float64 for float64 ``x``), as mamba_ssm; out in x's dtype, states
float32 (float64).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...errors import OptionError, ShapeError, fmt_shape, positive_int
from ..options import empty
from ..recurrent_ops import decay_attention
from .conv import _activation, _need, _need_int, causal_conv1d_fn, sequence_runs
from .fla_args import group_heads

__all__ = ["mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined"]


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def discretize(dt, dt_bias, softplus: bool, dt_limit, dtype) -> torch.Tensor:
    """``Δ = clamp(softplus?(dt + dt_bias), *dt_limit)`` in ``dtype`` (transformers' order)."""
    if not (isinstance(dt_limit, (tuple, list)) and len(dt_limit) == 2
            and all(isinstance(v, (int, float)) and not math.isnan(v) for v in dt_limit) and dt_limit[0] <= dt_limit[1]):
        raise OptionError(f"dt_limit must be a pair (low, high) of numbers, low <= high; got {dt_limit!r}")
    dt = dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])


def decaying(log_decay: torch.Tensor, what: str) -> None:
    """qkv's recurrences take a decaying state: ``Δ A`` finite and <= 0 (A < 0, Δ >= 0), or a
    ShapeError naming ``what`` (a growing state is not computed). One pass over ``Δ A`` where it
    passes: its least value above -inf and its largest <= 0 (a NaN makes both NaN, and fails)."""
    g = log_decay.detach()
    if g.numel() == 0:
        return
    lo, hi = torch.aminmax(g)
    if bool(lo > float("-inf")) and bool(hi <= 0):
        return
    bad = ~(torch.isfinite(g) & (g <= 0))
    if bad.any():
        raise ShapeError(f"{what} must be finite and <= 0 (a decaying state: A < 0, Δ >= 0); got "
                         f"{log_decay[bad].flatten()[0].item()}")


def packed_runs(seq_idx, cu_seqlens, Bsz: int, T: int):
    """``[[(start, end), ...] per batch row]`` of the packed sequences, or None (no packing)."""
    runs = None if seq_idx is None else sequence_runs(seq_idx)
    if cu_seqlens is None:
        return runs
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
        raise ShapeError(f"cu_seqlens must be a 1-D integer tensor (S + 1,); got "
                         f"{cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__}"
                         f"{'' if not isinstance(cu_seqlens, torch.Tensor) else ' ' + fmt_shape(cu_seqlens.shape)}")
    if Bsz != 1:
        raise ShapeError(f"cu_seqlens packs sequences along T of one batch row (x's B must be 1, as mamba_ssm); "
                         f"got B = {Bsz}")
    cuts = cu_seqlens.tolist()
    if len(cuts) < 2 or cuts[0] != 0 or cuts[-1] != T or any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise ShapeError(f"cu_seqlens must rise strictly from 0 to T = {T}; got {cuts}")
    mine = list(zip(cuts[:-1], cuts[1:]))
    if runs is not None and runs[0] != mine:
        raise ShapeError(f"seq_idx and cu_seqlens must mark the same sequences; seq_idx's are {runs[0]}, "
                         f"cu_seqlens' {mine}")
    return [mine]


def _ssd(q, k, v, g, s0, runs):
    """decay_attention over whole rows, or run by run: ``(y (B,H,T,P), final (B,H,N,P), [run finals])``."""
    if runs is None:
        y, S = decay_attention(q, k, v, g, scale=1.0, initial_state=s0, return_state=True)
        return y, S, []
    ys, finals, every = [], [], []
    for b, row in enumerate(runs):
        outs, S = [], None if s0 is None else s0[b:b + 1]
        if not row:   # T = 0
            outs.append(v[b:b + 1])
            S = S if S is not None else v.new_zeros(1, v.shape[1], k.shape[-1], v.shape[-1])
        for i, (s, e) in enumerate(row):
            start = S if i == 0 else None     # the first run starts from initial_states, the others from 0
            y, S = decay_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e], g[b:b + 1, :, s:e],
                                   scale=1.0, initial_state=start, return_state=True)
            outs.append(y)
            every.append(S[0])
        ys.append(torch.cat(outs, dim=2))
        finals.append(S)
    return torch.cat(ys, dim=0), torch.cat(finals, dim=0), every


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    """mamba_ssm's ``mamba_chunk_scan_combined``: Mamba-2's SSD (module docstring).

    Args:
        x: ``(B, T, H, P)``. dt: ``(B, T, H)``. A: ``(H,)`` (negative). B, C: ``(B, T, G, N)``, H % G = 0.
        chunk_size: a positive int (mamba_ssm's tile; the result does not depend on it).
        D: ``(H,)`` or ``(H, P)`` or None. z: ``(B, T, H, P)`` or None. dt_bias: ``(H,)`` or None.
        initial_states: ``(B, H, P, N)`` or None. seq_idx: ``(B, T)`` ints. cu_seqlens: ``(S + 1,)`` ints.
        dt_softplus, dt_limit: Δ as :func:`discretize`.

    Returns:
        ``out (B, T, H, P)``, then ``final_states (B, H, P, N)`` with ``return_final_states``,
        then ``varlen_states (S, H, P, N)`` with ``return_varlen_states``: ``out`` alone, or a tuple.
    """
    positive_int("chunk_size", chunk_size)
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ShapeError(f"x must have shape (B, T, H, P); got "
                         f"{fmt_shape(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    Bsz, T, H, P = x.shape
    _need("dt", dt, {"(B, T, H)": (Bsz, T, H)})
    _need("A", A, {"(H,)": (H,)})
    if not isinstance(B, torch.Tensor) or B.dim() != 4 or B.shape[:2] != (Bsz, T) or B.shape[2] == 0 \
            or H % B.shape[2]:
        raise ShapeError(f"B must have shape (B, T, G, N) = ({Bsz}, {T}, G, N) with H = {H} a multiple of G; got "
                         f"{fmt_shape(B.shape) if isinstance(B, torch.Tensor) else type(B).__name__}")
    G, N = B.shape[2:]
    _need("C", C, {"(B, T, G, N)": (Bsz, T, G, N)})
    _need("D", D, {"(H,)": (H,), "(H, P)": (H, P)}, required=False)
    _need("z", z, {"(B, T, H, P)": (Bsz, T, H, P)}, required=False)
    _need("dt_bias", dt_bias, {"(H,)": (H,)}, required=False)
    _need("initial_states", initial_states, {"(B, H, P, N)": (Bsz, H, P, N)}, required=False)
    _need_int("seq_idx", seq_idx, (Bsz, T), "(B, T)")
    if return_varlen_states and cu_seqlens is None:
        raise OptionError("return_varlen_states=True needs cu_seqlens (the sequences whose states it returns)")
    runs = packed_runs(seq_idx, cu_seqlens, Bsz, T)
    cdt = compute_dtype(x)
    delta = discretize(dt, dt_bias, dt_softplus, dt_limit, cdt)                        # Δ (B, T, H)
    g = (delta * A.to(cdt)).transpose(1, 2)                                              # Δ A (B, H, T)
    decaying(g, "dt · A (Δ after dt_bias, softplus and dt_limit, times A)")
    q = group_heads(C.to(cdt), H)                                                        # (B, H, T, N)
    k = group_heads(B.to(cdt), H)                                                        # (B, H, T, N)
    if torch.is_grad_enabled() and (x.requires_grad or delta.requires_grad):
        v = (x.to(cdt) * delta[..., None]).transpose(1, 2)                               # Δ x (B, H, T, P)
    else:   # written in qkv's layout by the product itself: the recurrence then copies nothing
        v = torch.mul(x.to(cdt).transpose(1, 2), delta.transpose(1, 2)[..., None],
                      out=empty((Bsz, H, T, P), cdt))                                     # Δ x (B, H, T, P)
    s0 = None if initial_states is None else initial_states.to(cdt).transpose(-1, -2)   # (B, H, N, P)
    y, S, every = _ssd(q, k, v, g, s0, runs)
    y = _dense_out(y.transpose(1, 2), x, D, z, cdt)                                      # (B, T, H, P)
    out = (y.to(x.dtype),)
    if return_final_states:   # C-ordered, as mamba_ssm's: the cache's state, stepped in place a token
        out += (S.transpose(-1, -2).contiguous(),)                                       # (B, H, P, N)
    if return_varlen_states:
        out += (torch.stack(every).transpose(-1, -2).contiguous(),)                      # (S, H, P, N)
    return out[0] if len(out) == 1 else out


def _dense_out(y, x, D, z, cdt):
    """``(y + x D) · silu(z)`` (each term where given) as a dense ``(B, T, H, P)`` tensor, as
    mamba_ssm's: ``y`` is qkv's ``(B, H, T, P)`` output seen transposed. Handed on transposed, every
    operation of the mixer after it (transformers' gated RMSNorm: pow, mean, products) ran on
    strided reads, 3 ns an element. Where no gradient is recorded (for any term: D or z alone may be
    trained) the two slabs (``x D``, then ``y`` added and the gate multiplied in place; ``silu(z)``)
    are on NumPy's pages (:func:`qkv.torch.options.empty`), and ``D`` is spread to ``(H, P)`` so that
    torch's loop runs over whole rows: at T = 8192, 16 heads of 64, 18 against 43 ms (a slab from
    torch's allocator, ``F.silu``'s, took 16 ms, 8 of them page faults; ``x (H, 1)``'s product and
    the sum into a third slab 7 ms each). The same numbers: each output the same rounded operations
    (``y + xD = xD + y``)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (y, x, D, z)):
        y = y if D is None else y + x.to(cdt) * (D.to(cdt)[:, None] if D.dim() == 1 else D.to(cdt))
        y = y if z is None else y * F.silu(z.to(cdt))
        return y.contiguous()
    gate = None if z is None else torch.ops.aten.silu.out(z.to(cdt), out=empty(y.shape, cdt))
    if D is None:
        return empty(y.shape, cdt).copy_(y) if gate is None else gate.mul_(y)
    Dc = D.to(cdt).reshape(D.shape[0], -1).expand(y.shape[-2:]).contiguous()            # (H, P)
    out = torch.mul(x.to(cdt), Dc, out=empty(y.shape, cdt)).add_(y)
    return out if gate is None else out.mul_(gate)


def gated_rmsnorm(y, z, weight, eps: float, groups: int, norm_before_gate: bool):
    """mamba_ssm's grouped gated RMSNorm over the last axis (``groups`` equal groups):
    ``norm(y) · w · silu(z)`` (norm_before_gate) or ``norm(y · silu(z)) · w``."""
    if not norm_before_gate:
        y = y * F.silu(z)
    yg = y.unflatten(-1, (groups, -1))                                                   # (..., G, dim / G)
    yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + eps)
    y = yg.flatten(-2) * weight.to(y.dtype)
    return y * F.silu(z) if norm_before_gate else y


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True):
    """mamba_ssm's ``mamba_split_conv1d_scan_combined``: a Mamba-2 mixer after its in-projection.

    ``zxbcdt (B, T, 2·d_mlp + 2·dim + 2·G·N + H)`` splits into ``[x0 x1 | z | xBC | dt]``
    (dim = H·P, ``d_mlp`` 0 in transformers' models); xBC ``(dim + 2·G·N)`` goes through
    :func:`~.conv.causal_conv1d_fn` (``conv1d_weight (dim + 2·G·N, K)``, SiLU for
    ``activation`` "silu"/"swish", None for None; ``seq_idx`` resets it) and splits into x, B,
    C; :func:`mamba_chunk_scan_combined` with ``dt_softplus=True``; then, with
    ``rmsnorm_weight (dim,)``, :func:`gated_rmsnorm` in G groups, else the scan's z gate;
    ``silu(x0) · x1`` is put before it where ``d_mlp > 0``; last ``F.linear(·, outproj_weight
    (out, d_mlp + dim), outproj_bias)`` where given.

    Returns ``out (B, T, out or d_mlp + dim)`` in zxbcdt's dtype, with ``return_final_states``
    ``(out, final_states (B, H, P, N))``.
    """
    _activation("activation", activation)
    if not isinstance(D, torch.Tensor) or D.dim() not in (1, 2):
        raise ShapeError(f"D must have shape (H,) or (H, P); got "
                         f"{fmt_shape(D.shape) if isinstance(D, torch.Tensor) else type(D).__name__}")
    if D.dim() == 1 and headdim is None:
        raise OptionError("headdim is required where D has shape (H,) (the heads' width P is read from it)")
    H = D.shape[0]
    P = D.shape[1] if D.dim() == 2 else positive_int("headdim", headdim)
    G = positive_int("ngroups", ngroups)
    dim = H * P
    if not isinstance(zxbcdt, torch.Tensor) or zxbcdt.dim() != 3:
        raise ShapeError(f"zxbcdt must have shape (B, T, 2 d_mlp + 2 dim + 2 G N + H); got "
                         f"{fmt_shape(zxbcdt.shape) if isinstance(zxbcdt, torch.Tensor) else type(zxbcdt).__name__}")
    conv_dim = conv1d_weight.shape[0] if isinstance(conv1d_weight, torch.Tensor) else -1
    if H % G or conv_dim <= dim or (conv_dim - dim) % (2 * G):
        raise ShapeError(f"conv1d_weight must have shape (dim + 2 G N, K) with dim = H P = {dim}, G = ngroups = {G} "
                         f"dividing H = {H}; got {fmt_shape(conv1d_weight.shape) if conv_dim >= 0 else conv1d_weight!r}")
    N = (conv_dim - dim) // (2 * G)
    rest = zxbcdt.shape[-1] - 2 * dim - 2 * G * N - H
    if rest < 0 or rest % 2:
        raise ShapeError(f"zxbcdt's last axis must be 2 d_mlp + 2 dim + 2 G N + H = 2 d_mlp + {2 * dim + 2 * G * N + H}"
                         f" (dim = {dim}, G N = {G * N}, H = {H}); got {zxbcdt.shape[-1]}")
    d_mlp = rest // 2
    _need("rmsnorm_weight", rmsnorm_weight, {"(dim,)": (dim,)}, required=False)
    x01, z, xBC, dt = torch.split(zxbcdt, [2 * d_mlp, dim, dim + 2 * G * N, H], dim=-1)
    xBC = causal_conv1d_fn(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx,
                           activation=activation).transpose(1, 2)                      # (B, T, dim + 2 G N)
    x, B, C = torch.split(xBC, [dim, G * N, G * N], dim=-1)
    z = z.unflatten(-1, (H, P))
    y, final = mamba_chunk_scan_combined(
        x.unflatten(-1, (H, P)), dt, A, B.unflatten(-1, (G, N)), C.unflatten(-1, (G, N)), chunk_size, D=D,
        z=None if rmsnorm_weight is not None else z, dt_bias=dt_bias, initial_states=initial_states,
        seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit, return_final_states=True)
    if rmsnorm_weight is not None:
        cdt = compute_dtype(y)
        y = gated_rmsnorm(y.flatten(-2).to(cdt), z.flatten(-2).to(cdt), rmsnorm_weight, rmsnorm_eps, G,
                          bool(norm_before_gate)).to(zxbcdt.dtype)                       # (B, T, dim)
    else:
        y = y.flatten(-2)
    if d_mlp:
        x0, x1 = x01.chunk(2, dim=-1)
        y = torch.cat([F.silu(x0) * x1, y], dim=-1)                                       # (B, T, d_mlp + dim)
    if outproj_weight is not None:
        _need("outproj_weight", outproj_weight, {"(out, d_mlp + dim)": (outproj_weight.shape[0], d_mlp + dim)})
        y = F.linear(y.to(outproj_weight.dtype), outproj_weight, outproj_bias)
    return (y, final) if return_final_states else y
