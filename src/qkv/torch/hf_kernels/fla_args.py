"""The boundary of :mod:`qkv.torch.hf_kernels.fla`: fla's ``(B, T, H, ·)`` tensors checked in
fla's names and turned into one call of qkv's delta rule a packed sequence; the gates fla can
compute inside its kernels (``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``) written
out in torch, differentiably.

fla's layout: ``q, k (B, T, H, K)``, ``v (B, T, HV, V)`` with ``HV % H == 0`` (grouped value
attention: q and k head ``h`` serves value heads ``h·G .. h·G + G - 1``, ``G = HV / H``, as
``repeat_interleave`` makes them), ``beta (B, T, HV)``, a decay ``(B, T, HV)`` (Gated
DeltaNet) or ``(B, T, HV, K)`` (KDA), states ``(N, HV, K, V)`` (``(N, HV, V, K)`` with
``state_v_first``), ``N`` the batch or, with ``cu_seqlens``, the number of packed sequences.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import OptionError, ShapeError, fmt_shape
from ..options import empty

L2NORM_EPS = 1e-6   # fla's l2norm: x / sqrt(Σ x² + eps), in its kernels and transformers' fallbacks


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla's ``use_qk_l2norm_in_kernel``: ``x / sqrt(Σ_d x_d² + 1e-6)`` over the last axis."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def group_heads(x: torch.Tensor, H: int) -> torch.Tensor:
    """``(B, T, G, N) -> (B, H, T, N)``: ``x``'s head (or group) g for heads ``g·H/G .. (g+1)·H/G
    - 1``: ``repeat_interleave(H // G, dim=2)`` moved to qkv's layout, written C-ordered by one
    copy (fla's q and k for the value heads; mamba_ssm's B and C for the heads of their group).
    ``repeat_interleave`` and then the transposed view's copy took 5 times as long."""
    B, T, G, N = x.shape
    return x.transpose(1, 2)[:, :, None].expand(B, G, H // G, T, N).reshape(B, H, T, N)


def kernel_heads(x: torch.Tensor, H: int, norm: bool) -> torch.Tensor:
    """q or k ``(B, T, G, K)`` for the kernel without a gradient: :func:`l2norm` (``norm``) and
    :func:`group_heads` (``H`` heads) in one pass, the normalising product written straight into
    the C-ordered ``(B, H, T, K)`` that the kernel reads, on NumPy's pages (each group's head
    repeated by the product's expanded operands). The two steps wrote a ``(B, T, G, K)`` slab and
    then copied it: 16 against 8 ms for each of q and k with 4 key heads and 8 value heads of 128
    at T = 8192. The same numbers: the same sums, and each output one rounded product, wherever
    it is written."""
    B, T, G, N = x.shape
    out = empty((B, G, H // G, T, N), x.dtype)
    src = x.transpose(1, 2)[:, :, None].expand(out.shape)                   # (B, G, H/G, T, N), a view
    if not norm:
        return out.copy_(src).view(B, H, T, N)
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)             # (B, T, G, 1), as l2norm()
    return torch.mul(src, r.transpose(1, 2)[:, :, None].expand(out.shape), out=out).view(B, H, T, N)


def refuse(where: str, name: str, value, what: str) -> None:
    """A variant of fla's function qkv does not compute, refused by name."""
    raise OptionError(f"{where}: {name}={value!r} ({what}) is not computed by qkv; "
                      f"call fla's own kernel for it")


def _check_shape(name: str, x, want: tuple, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ShapeError(f"{name} must be a torch.Tensor of shape {layout} = {fmt_shape(want)}; "
                         f"got {type(x).__name__}")
    if tuple(x.shape) != want:
        raise ShapeError(f"{name} must have shape {layout} = {fmt_shape(want)}; got {fmt_shape(x.shape)}")


@dataclass
class Heads:
    """The sizes of one call: ``B, T, H, K, HV, V``."""
    B: int
    T: int
    H: int
    K: int
    HV: int
    V: int


def heads(where: str, q, k, v) -> Heads:
    """Check q, k, v in fla's layout; the sizes."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            got = fmt_shape(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ShapeError(f"{where}: {name} must be a 4-D tensor (B, T, H, K) (fla's layout, "
                             f"head_first=False); got {got}")
    B, T, H, K = q.shape
    if H == 0 or K == 0:
        raise ShapeError(f"{where}: q must have at least one head and one key channel, (B, T, H, K) with "
                         f"H, K >= 1; got {fmt_shape(q.shape)}")
    _check_shape("k", k, (B, T, H, K), "q's shape (B, T, H, K)")
    if tuple(v.shape[:2]) != (B, T) or v.shape[2] % H:
        raise ShapeError(f"{where}: v must have shape (B, T, HV, V) with B, T = {B}, {T} and HV a multiple "
                         f"of q's H = {H} (grouped value heads); got {fmt_shape(v.shape)}")
    return Heads(B, T, H, K, v.shape[2], v.shape[3])


def check_gates(n: Heads, beta, g, g_layout: str) -> None:
    """beta ``(B, T, HV)`` (a write strength a value head: a beta a value channel, which fla's
    fused recurrent kernel also takes, is refused by its shape) and the decay."""
    _check_shape("beta", beta, (n.B, n.T, n.HV), "(B, T, HV)")
    if g is not None:
        want = (n.B, n.T, n.HV) if g_layout == "head" else (n.B, n.T, n.HV, n.K)
        _check_shape("g", g, want, "(B, T, HV)" if g_layout == "head" else "(B, T, HV, K)")


def offsets(where: str, cu_seqlens, n: Heads) -> list:
    """The packed sequences' bounds ``[(start, end), ...]``: ``cu_seqlens`` (N+1 offsets from 0
    to T, B = 1), or one sequence a batch row (None)."""
    if cu_seqlens is None:
        return None
    if n.B != 1:
        raise ShapeError(f"{where}: with cu_seqlens the batch size must be 1 (the sequences packed along T); "
                         f"got B = {n.B}")
    cu = torch.as_tensor(cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 2 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise ShapeError(f"cu_seqlens must be a 1-D integer tensor of N+1 >= 2 offsets; got "
                         f"{cu.dtype} of shape {fmt_shape(cu.shape)}")
    c = [int(x) for x in cu.tolist()]
    if c[0] != 0 or c[-1] != n.T or any(b < a for a, b in zip(c[:-1], c[1:])):
        raise ShapeError(f"cu_seqlens must rise from 0 to T = {n.T} (the packed length); got {c}")
    return list(zip(c[:-1], c[1:]))


def state_in(name: str, s, N: int, n: Heads, v_first: bool):
    """An initial state in qkv's ``(N, HV, K, V)``: checked, and transposed from ``(N, HV, V, K)``
    where ``state_v_first``."""
    if s is None:
        return None
    want = (N, n.HV, n.V, n.K) if v_first else (N, n.HV, n.K, n.V)
    _check_shape(name, s, want, "(N, HV, V, K)" if v_first else "(N, HV, K, V)")
    return s.transpose(-1, -2) if v_first else s


def beta_of(beta, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, where: str):
    """fla's beta: as given, or ``sigmoid(beta)`` (``2·sigmoid(beta)`` with ``allow_neg_eigval``)."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise OptionError(f"{where}: allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True "
                          f"(it doubles sigmoid(beta)); got use_beta_sigmoid_in_kernel=False")
    if not use_beta_sigmoid_in_kernel:
        return beta
    return beta.sigmoid() * (2.0 if allow_neg_eigval else 1.0)


def gdn_gate(g, A_log, dt_bias):
    """Gated DeltaNet's log decay from the raw gate: ``-exp(A_log) · softplus(g + dt_bias)``,
    ``A_log, dt_bias (HV,)``, in float32 at least (transformers' and fla's)."""
    x = g.float() if g.dtype != torch.float64 else g
    if dt_bias is not None:
        x = x + dt_bias
    return -A_log.to(x.dtype).exp() * F.softplus(x)


def kda_gate(g, A_log, dt_bias, lower_bound):
    """KDA's log decay a key channel from the raw gate ``g (B, T, HV, K)``, ``dt_bias (HV·K,)``:
    ``-exp(A_log) · softplus(g + dt_bias)``, or with ``lower_bound``
    ``lower_bound · sigmoid(exp(A_log) · (g + dt_bias))`` (``A_log`` None: factor 1)."""
    HV, K = g.shape[-2:]
    x = g.float() if g.dtype != torch.float64 else g
    if dt_bias is not None:
        x = x + dt_bias.reshape(HV, K)
    if lower_bound is None:
        return -A_log.to(x.dtype).reshape(HV, 1).exp() * F.softplus(x)
    if A_log is not None:
        x = A_log.to(x.dtype).reshape(HV, 1).exp() * x
    return float(lower_bound) * torch.sigmoid(x)
