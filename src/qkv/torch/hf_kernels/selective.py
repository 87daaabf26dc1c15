"""mamba_ssm's selective scan (Mamba-1) and one decoding step of a Mamba state, under the
package's names and signatures: ``selective_scan_fn`` (as transformers' Mamba, FalconMamba
and Jamba call it) and ``selective_state_update`` (Mamba-1 and Mamba-2 shapes).

**The selective scan is a diagonal recurrence of width D·N.** Per channel d and state n::

    h_t[d, n] = exp(Δ_t[d] A[d, n]) h_{t-1}[d, n] + Δ_t[d] B_t[n] u_t[d]
    y_t[d]    = Σ_n C_t[n] h_t[d, n] + D[d] u_t[d],      out_t = y_t · silu(z_t[d])

with ``Δ = softplus?(delta + delta_bias)``: :func:`qkv.torch.linear_scan` with
``x = Δ B u`` and ``log_a = Δ A`` flattened to width D·N, so autograd differentiates it
through qkv's scan operator; B and C may be one per channel (``(D, N)``, time-invariant), one
per step ``(B, N, T)`` or one per group of D/G channels ``(B, G, N, T)``.

**One step** (``selective_state_update``) is elementwise, in place on ``state``::

    state = state · exp(Δ A) + Δ B x,      out = state C + D x,   · silu(z)

Compute in float32 (float64 for float64 inputs), as mamba_ssm; out in the input's dtype.
Without a gradient (and without ``state_batch_indices``) the step is one compiled pass over
the state (:func:`_compiled_step`): the state's bits of the torch steps, the read summed in
float64.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ... import jit
from ...errors import OptionError, ShapeError, fmt_shape
from ..options import NUMPY_DTYPES
from ..recurrent_ops import linear_scan
from .conv import _need, _need_int, cast, distinct_rows
from .decode import _array
from .mamba import decaying

__all__ = ["selective_scan_fn", "selective_state_update"]


def _per_step(name: str, t, Bsz: int, Dd: int, N: int, T: int, dtype) -> torch.Tensor:
    """B or C as ``(B, T, D, N)`` from ``(D, N)``, ``(B, N, T)`` or ``(B, G, N, T)``."""
    if isinstance(t, torch.Tensor) and t.is_complex():
        raise OptionError(f"{name} must be real (qkv computes the real selective scan; mamba_ssm's complex one is "
                          f"not computed); got {t.dtype}")
    ok = isinstance(t, torch.Tensor) and (
        tuple(t.shape) in ((Dd, N), (Bsz, N, T)) or (t.dim() == 4 and t.shape[0] == Bsz and t.shape[2:] == (N, T)
                                                    and t.shape[1] > 0 and Dd % t.shape[1] == 0))
    if not ok:
        raise ShapeError(f"{name} must have shape (D, N) = ({Dd}, {N}), (B, N, T) = ({Bsz}, {N}, {T}) or "
                         f"(B, G, N, T) with G dividing D = {Dd}; got "
                         f"{fmt_shape(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    t = t.to(dtype)
    if t.dim() == 2:
        return t[None, None].expand(Bsz, T, Dd, N)
    if t.dim() == 3:
        return t.permute(0, 2, 1)[:, :, None, :]                                          # (B, T, 1, N)
    return t.permute(0, 3, 1, 2).repeat_interleave(Dd // t.shape[1], dim=2)              # (B, T, D, N)


def _c(t: torch.Tensor | None, dtype, empty: int) -> np.ndarray:
    """:func:`qkv.torch.hf_kernels.decode._array` of ``t`` (C-ordered, ``dtype``, a view where it is
    one), a stride-0 last axis cut to one entry first; None: an empty array of ``empty`` axes."""
    if t is None:
        return np.empty((0,) * empty, NUMPY_DTYPES[dtype])
    return _array(t[..., :1] if t.dim() and t.stride(-1) == 0 and t.shape[-1] > 1 else t, dtype)


def _compiled_step(fast, st, x, delta, decay, B, C, D, z, cdt) -> torch.Tensor:
    """:func:`selective_state_update` without a gradient in one compiled pass over the state
    (:func:`qkv.recurrent.scan.compiled.selective_step`): ``st (B, H, P, N)`` in place, C-ordered
    in the compute dtype. The state's numbers are the torch steps' (each product, then the sum);
    the output's read ``Σ_n state C`` sums in float64 (torch's sum rounds at each of its partial
    sums), then D x and the gate as torch rounds them: 90 against 15 µs a step at 16 heads of
    (64, 64) (one thread)."""
    out = np.empty(tuple(x.shape), NUMPY_DTYPES[cdt])
    fast.selective_step(st.numpy(), _c(x, cdt, 3), _c(delta, cdt, 3), _c(decay, cdt, 4), _c(B, cdt, 3),
                        _c(C, cdt, 3), _c(D, cdt, 2), _c(z, cdt, 3), out)
    return cast(torch.from_numpy(out), x.dtype)


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False):
    """mamba_ssm's ``selective_scan_fn`` (module docstring).

    Args:
        u, delta: ``(B, D, T)``. A: ``(D, N)``, real, ``Δ A <= 0``. B, C: ``(D, N)``,
            ``(B, N, T)`` or ``(B, G, N, T)``. D: ``(D,)`` or None. z: ``(B, D, T)`` or None.
        delta_bias: ``(D,)`` or None. delta_softplus: softplus on ``delta + delta_bias``.

    Returns:
        ``out (B, D, T)`` in u's dtype; with ``return_last_state``, ``(out, last_state (B, D, N))``.
    """
    if not isinstance(u, torch.Tensor) or u.dim() != 3:
        raise ShapeError(f"u must have shape (B, D, T); got "
                         f"{fmt_shape(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__}")
    Bsz, Dd, T = u.shape
    _need("delta", delta, {"(B, D, T)": (Bsz, Dd, T)})
    if not isinstance(A, torch.Tensor) or A.dim() != 2 or A.shape[0] != Dd:
        raise ShapeError(f"A must have shape (D, N) = ({Dd}, N); got "
                         f"{fmt_shape(A.shape) if isinstance(A, torch.Tensor) else type(A).__name__}")
    if A.is_complex():
        raise OptionError(f"A must be real (mamba_ssm's complex selective scan is not computed); got {A.dtype}")
    N = A.shape[1]
    _need("D", D, {"(D,)": (Dd,)}, required=False)
    _need("z", z, {"(B, D, T)": (Bsz, Dd, T)}, required=False)
    _need("delta_bias", delta_bias, {"(D,)": (Dd,)}, required=False)
    cdt = torch.float64 if u.dtype == torch.float64 else torch.float32
    Bt, Ct = (_per_step(n, t, Bsz, Dd, N, T, cdt) for n, t in (("B", B), ("C", C)))     # (B, T, D|1, N)
    dl = delta.to(cdt)
    if delta_bias is not None:
        dl = dl + delta_bias.to(cdt)[:, None]
    if delta_softplus:
        dl = F.softplus(dl)
    dl, uT = dl.transpose(1, 2), u.to(cdt).transpose(1, 2)                               # Δ, u (B, T, D)
    log_a = (dl[..., None] * A.to(cdt)).reshape(Bsz, T, Dd * N)                          # Δ A (B, T, D N)
    decaying(log_a, "delta · A (Δ after delta_bias and softplus, times A)")
    xs = ((dl * uT)[..., None] * Bt).reshape(Bsz, T, Dd * N)                             # Δ B u (B, T, D N)
    h, hT = linear_scan(xs, log_a, return_state=True)                                   # (B, T, D N), (B, D N)
    y = (h.unflatten(-1, (Dd, N)) * Ct).sum(-1)                                          # (B, T, D)
    if D is not None:
        y = y + uT * D.to(cdt)
    y = y.transpose(1, 2)                                                                # (B, D, T)
    if z is not None:
        y = y * F.silu(z.to(cdt))
    out = y.to(u.dtype)
    return (out, hT.unflatten(-1, (Dd, N))) if return_last_state else out


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None):
    """mamba_ssm's ``selective_state_update``: one step, ``state`` updated in place (module docstring).

    Mamba-1 shapes: state ``(B, D, N)``, x, dt, z ``(B, D)``, A ``(D, N)``, B, C ``(B, N)``,
    D, dt_bias ``(D,)``. Mamba-2: state ``(B, H, P, N)``, x, dt, z ``(B, H, P)``, A ``(H, P, N)``,
    B, C ``(B, G, N)`` (G dividing H), D, dt_bias ``(H, P)`` (transformers passes them expanded
    from ``(H,)``). ``state_batch_indices (B,)``: the rows of a larger ``state`` to step.

    Returns ``out`` of x's shape and dtype.
    """
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
        raise ShapeError(f"x must have shape (B, D) (Mamba-1) or (B, H, P) (Mamba-2); got "
                         f"{fmt_shape(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    one = x.dim() == 2      # Mamba-1: one head of P = D channels, one group
    if one:
        x, dt, z = x[:, None], dt[:, None] if isinstance(dt, torch.Tensor) else dt, None if z is None else z[:, None]
        A = A[None] if isinstance(A, torch.Tensor) else A
        B, C = (t[:, None] if isinstance(t, torch.Tensor) and t.dim() == 2 else t for t in (B, C))
        D, dt_bias = (t[None] if isinstance(t, torch.Tensor) else t for t in (D, dt_bias))
    Bsz, H, P = x.shape
    _need("dt", dt, {"x's shape": (Bsz, H, P)})
    if not isinstance(A, torch.Tensor) or A.dim() != 3 or A.shape[:2] != (H, P):
        raise ShapeError(f"A must have shape {'(D, N)' if one else '(H, P, N)'} matching x; got "
                         f"{fmt_shape(A.shape[1:] if one else A.shape) if isinstance(A, torch.Tensor) else A!r}")
    N = A.shape[2]
    if not isinstance(B, torch.Tensor) or B.dim() != 3 or B.shape[0] != Bsz or B.shape[2] != N \
            or B.shape[1] == 0 or H % B.shape[1]:
        raise ShapeError(f"B must have shape {'(B, N)' if one else '(B, G, N) with G dividing H'} = "
                         f"({Bsz}, {'' if one else 'G, '}{N}); got "
                         f"{fmt_shape(B.shape[:1] + B.shape[2:] if one and B.dim() == 3 else B.shape) if isinstance(B, torch.Tensor) else B!r}")
    G = B.shape[1]
    _need("C", C, {"B's shape": tuple(B.shape)})
    _need("D", D, {"(H, P)": (H, P)}, required=False)
    _need("z", z, {"x's shape": (Bsz, H, P)}, required=False)
    _need("dt_bias", dt_bias, {"(H, P)": (H, P)}, required=False)
    if not isinstance(state, torch.Tensor) or state.dim() != (3 if one else 4):
        raise ShapeError(f"state must have shape {'(B, D, N)' if one else '(B, H, P, N)'}; got "
                         f"{fmt_shape(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__}")
    st = state[:, None] if one else state                                               # (B', H, P, N)
    if st.shape[1:] != (H, P, N) or (state_batch_indices is None and st.shape[0] != Bsz):
        raise ShapeError(f"state must have shape {(Bsz, P, N) if one else (Bsz, H, P, N)} (B', with "
                         f"state_batch_indices); got {fmt_shape(state.shape)}")
    _need_int("state_batch_indices", state_batch_indices, (Bsz,), "(B,)")
    rows = None
    if state_batch_indices is not None:
        rows = state_batch_indices.long()
        if rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < st.shape[0]):
            raise ShapeError(f"state_batch_indices must lie in [0, {st.shape[0]}) (rows of state); got {rows.tolist()}")
        distinct_rows("state_batch_indices", rows, "state")
    cdt = torch.float64 if torch.float64 in (state.dtype, x.dtype) else torch.float32
    # transformers' Mamba-2 passes dt, dt_bias (one a head) and A (one a head) expanded over P and N
    # (stride 0): Δ and the decay exp(Δ A) are then made once a head, not P·N times (the same numbers)
    per_head = dt.stride(-1) == 0 and (dt_bias is None or dt_bias.stride(-1) == 0)
    delta = cast(dt[..., :1] if per_head else dt, cdt) + \
        (0 if dt_bias is None else cast(dt_bias[..., :1] if per_head else dt_bias, cdt))
    if dt_softplus:
        delta = F.softplus(delta)                                                          # Δ (B, H, P | 1)
    A = A[:, :1] if A.stride(1) == 0 else A
    A = A[..., :1] if A.stride(2) == 0 else A                                            # (H, P | 1, N | 1)
    # a step is ~15 small torch calls, each a few µs: none is spent where it changes no number.
    # One group (G = 1): B and C broadcast over the heads, no copy; a gradient (through a copy,
    # to sum over the heads as before) or the old state (kept for it) only where one is wanted
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (state, x, dt, A, B, C, dt_bias))
    if not grad and rows is None and st.dtype == cdt and (fast := jit.load(jit.SCAN)):
        work = st if st.is_contiguous() else st.contiguous()                           # (stepped, then put back)
        out = _compiled_step(fast, work, x, delta, torch.exp(delta[..., None] * cast(A, cdt)), B, C, D, z, cdt)
        if work is not st:
            st.copy_(work)
        return out[:, 0] if one else out
    Bh, Ch = (cast(t, cdt)[:, :, None, :] if G == 1 and not grad else
              cast(t, cdt).repeat_interleave(H // G, dim=1)[:, :, None, :] for t in (B, C))   # (B, H | 1, 1, N)
    xc = cast(x, cdt)
    decay, written = torch.exp(delta[..., None] * cast(A, cdt)), (delta * xc)[..., None] * Bh
    if not grad and rows is None and st.dtype == cdt:
        new = st.mul_(decay).add_(written)                                              # in place: the same bits, no copy
    else:
        old = cast(st if rows is None else st[rows], cdt)                               # (B, H, P, N)
        old = old.clone() if grad else old                                              # kept for the gradient
        new = old * decay + written
        if rows is None:
            st.copy_(new)
        else:
            st[rows] = cast(new, st.dtype)
    out = (new * Ch).sum(-1)                                                             # (B, H, P)
    if D is not None:
        out = out + xc * cast(D, cdt)
    if z is not None:
        out = out * F.silu(cast(z, cdt))
    out = cast(out, x.dtype)
    return out[:, 0] if one else out
