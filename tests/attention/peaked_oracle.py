"""A dense float64 oracle for dq and dk where rows of P are nearly one-hot.

The library's reference takes ``delta = rowsum(dO ∘ O)`` and forms ``dP - delta``, which
cancels where one key r holds nearly all of a row's weight (``P_ir = 1 - ε``): the true
``dP_ir - delta_i`` is of size ε while both terms are of size ``|dP|``. This oracle uses
``ΣP = 1`` to write it without the cancellation::

    dP_ij - delta_i = D_ij - e_i,   D_ij = dO_i · (v_j - v_r),   e_i = Σ_j P_ij D_ij

with ``D_ir = 0`` exactly (``r`` the row's argmax) and ``P_ij = exp(x_ij - m_i) / l_i``.
Self-attention with ``causal`` (top-left) and ``window``, float64, ``(B, H, T, D)``.
"""
import numpy as np


def stable_grads(dout, q, k, v, *, scale, causal=False, window=None, dlse=None):
    """``(dq, dk)`` to float64 rounding, every row relatively exact; ``dlse (B, H, T)``, the
    gradient of lse where the loss uses it, adds ``P ∘ dlse`` to dS."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    t = q.shape[-2]
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    allowed = np.ones((t, t), bool)
    if causal:
        allowed &= j <= i
    if window is not None:
        left, right = (window, 0) if np.isscalar(window) else window
        allowed &= (j >= i - left) & (j <= i + right)
    x = np.where(allowed, scale * q @ np.swapaxes(k, -1, -2), -np.inf)   # (B,H,T,D) @ (B,H,D,T) -> (B,H,T,T)
    m = x.max(axis=-1, keepdims=True)
    r = x.argmax(axis=-1)                                                # (B,H,T)
    w = np.exp(x - m)                                                    # w_ir = 1 exactly
    p = w / w.sum(axis=-1, keepdims=True)
    vr = np.take_along_axis(v, r[..., None], axis=-2)                    # (B,H,T,Dv): v at each row's argmax
    diff = v[..., None, :, :] - vr[..., :, None, :]                      # (B,H,T,T,Dv): v_j - v_r
    dd = np.einsum("bhid,bhijd->bhij", dout, diff)                       # D_ij, exactly 0 at j = r
    e = np.sum(p * dd, axis=-1, keepdims=True)
    ds = p * (dd - e)                                                    # dS = P ∘ (dP - delta)
    if dlse is not None:
        ds += p * np.asarray(dlse, np.float64)[..., None]                # + P ∘ dlse
    return scale * ds @ k, scale * np.swapaxes(ds, -1, -2) @ q          # dq (B,H,T,D), dk (B,H,T,D)


def peaked_inputs(rng, shape=(2, 4, 24, 8), boost=3.0):
    """q, k (times ``boost``), v, dout: with a scale of about 20 most rows are nearly one-hot."""
    q, k, v, dout = (rng.standard_normal(shape) for _ in range(4))
    return boost * q, boost * k, v, dout


def rel_err(got, want):
    """Largest error over the largest true entry."""
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


def row_err(got, want):
    """The worst row's largest error over that row's largest true entry."""
    e = np.max(np.abs(np.asarray(got, np.float64) - want), axis=-1)
    top = np.max(np.abs(want), axis=-1)
    return float(np.max(np.where(top > 0, e / np.where(top > 0, top, 1), e)))


def one_hot_inputs(rng, T=24, shape=(2, 4), d=64, dv=16):
    """q = k of norm 8 in D = 64 (nearly orthogonal directions), v, dout: with ``scale =
    0.625`` each query's own key leads the others by a score gap of about 20 to 50, so every
    row is nearly one-hot and the largest true dq is about 1e-9."""
    q = rng.standard_normal(shape + (T, d))
    q *= 8 / np.linalg.norm(q, axis=-1, keepdims=True)
    return q, q.copy(), rng.standard_normal(shape + (T, dv)), rng.standard_normal(shape + (T, dv))


def dense_float32_torch(arrays, opts, want):
    """Dense torch's (SDPA with its mask, autograd) ``(dq, dk)`` errors, in the arrays' dtype."""
    import torch

    q, k, v, dout = (torch.tensor(np.asarray(x)) for x in arrays)
    q.requires_grad_(True)
    k.requires_grad_(True)
    t = q.shape[-2]
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    allowed = np.ones((t, t), bool)
    if opts.get("causal"):
        allowed &= j <= i
    if opts.get("window") is not None:
        allowed &= j >= i - opts["window"]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=torch.tensor(allowed),
                                                           scale=opts["scale"])
    out.backward(dout)
    return rel_err(q.grad.numpy(), want[0]), rel_err(k.grad.numpy(), want[1])
