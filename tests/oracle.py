"""The test-side oracle: attention written from the README's definitions alone, in float64.

Nothing here imports qkv: every rule is spelled out from the README's option table and the
docstring of ``qkv.attention``, so a test that compares qkv with this module checks the
semantics rather than repeating the implementation.

**Which keys a query sees.** Query row ``i`` of batch item ``b`` sits at the aligned position
``i' = i + off_b`` with ``off_b = 0`` (``align="top_left"``, the default) or
``off_b = Tk_b - Tq_b`` (``"bottom_right"``; ``Tk_b = kv_lengths[b]``, ``Tq_b = q_lengths[b]``,
else the array lengths). ``causal=True`` (or ``"top_left"``/``"bottom_right"``, shorthands
for ``causal=True`` with that align): ``j <= i'``. ``window=(left, right)``:
``i' - left <= j <= i' + right``, a ``None`` side unbounded, ``window=n`` is ``(n, 0)``.
``chunk=C``: ``i' // C == j // C`` (floor division). Keys ``j >= kv_lengths[b]`` and rows
``i >= q_lengths[b]`` do not exist. ``mask``: True = may attend. The rules are evaluated in
Python integers (object arrays), so ``window=2**63`` or ``chunk=10**30`` mean exactly what
they say. ``b`` is the first leading axis of the output, the head ``h`` the last.

**What is added to a score**: ``bias`` and ALiBi's ``-slope[h] * |i' - j|`` (slopes ``(Hq,)``
or ``(B, Hq)``), in float64 (or the wider compute dtype). A ``-inf`` entry (of the bias or from the product) means
"may not attend".

**Softcap** ``c``: the scaled product ``x = scale · q kᵀ`` becomes ``c · tanh(x / c)`` before
the additive term and the masks (so ``ds/dx = 1 - tanh²(x / c)`` in the gradients).
**Dropout** ``p`` with ``seed``: the weights become ``P ∘ keep / (1 - p)`` after the softmax
(lse stays undropped; ``weights`` are the dropped ones), with ``keep`` the README's
counter-based function of (seed, batch, head, row, column): splitmix64's finaliser chained
over seed, batch (flat index of the leading axes before the head), head and row, then
murmur3's 32-bit finaliser of ``(key_lo XOR column · 0x9E3779B1) + key_hi`` compared with
``⌊p · 2^32⌋`` (:func:`keep_mask`).

**The attention**: ``s = scale · q kᵀ + additive`` (default ``scale = 1/sqrt(D)``) on the
allowed entries, ``-inf`` elsewhere; ``P = softmax(s)`` per row after subtracting the row
maximum (so a bias of -1e30 or -1e38 is exact: when every score of a row is ``-1e30 + s_j``
float64 itself has already lost the ``s_j``, ulp(1e30) ~ 1.4e14, and the answer is the
uniform row that float64 arithmetic gives); ``out = P v``, ``lse = m + log Σ exp(s - m)``.
A row that may attend to nothing gets out 0, lse ``-inf``, weights 0 and gradient 0.
Gradients by the softmax Jacobian written directly: ``dP = dout vᵀ``,
``dS = P ∘ (dP - rowsum(P ∘ dP))``, ``dq = scale · dS k``, ``dk = scale · dSᵀ q``,
``dv = Pᵀ dout``. ``gqa=True`` repeats each kv head for its ``G = Hq // Hkv`` query heads
(heads ``h*G .. h*G+G-1`` share kv head h) and sums the gradients back; broadcast leading
axes are summed back too.

**Inputs are taken as given**: float32 q, k, v are their float32 values, a float64 bias is
its float64 values, and everything is computed in ``dtype`` (float64 by default). With
``dtype=np.float32`` the same code is the *plain float32 dense computation* that the error
budget (DESIGN.md, "Numerics policy") is measured against; there the bias and the ALiBi
term are each rounded to float32 (the ALiBi term made in float64 first and saturating at
``±finfo(float32).max``: slopes of 1e39 would otherwise turn into ``inf · 0 = NaN``) and
added in float32. ``dtype=np.longdouble`` judges float64.

Beside the values, :func:`solve` returns the size ``Σ|terms|`` of every result (``P |v|``
for out, ``|lse| + 1 + Σ_j P_ij (|scale| |q_i|·|k_j| + |bias_ij|)`` for lse,
``|scale| P (|dout| |v|ᵀ + rowsum(P |dout| |v|ᵀ)) |k|`` for dq, ...): a floor for
error budgets, below which an error is rounding of the result itself.

With ``moved=True``, also ``moved``: what rounding the scores alone moves out, dq, dk and dv
by, in units of eps (first order, root-sum-square over independent roundings). Every
implementation rounds ``s_ij`` by up to ``eps·t_ij``, ``t_ij = |scale| |q_i|·|k_j| +
|bias_ij|``: a float64 row of scores of 5e3 errs 1e-13 whatever computes it, and where one
entry decides the row, how near a score falls to a float is luck (another BLAS, another
summation order: 4e-15 or 3e-13 for the same row). Terms past 2^23 (a mask value's: -1e30,
finfo.min) are rounded away alike everywhere and left out.

Also here: RoPE (half-split pairs, ``theta_i = base^(-2i/D)``), the ALiBi slopes of Press et
al., and the forward and backward of ``qkv.nn.MultiHeadAttention`` / ``SelfAttention`` as
their docstrings define them (projections ``x W + b``, heads ``h*D .. h*D+D-1``), on the
layer's own parameters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["alignment", "parse_window", "offsets", "allowed", "additive", "solve", "attention",
           "attention_grad", "rope", "alibi_slopes", "mha", "self_attention", "Solution", "LayerSolution"]


# ----------------------------------------------------------------------------- the rules
def alignment(causal=False, align=None) -> tuple[bool, str]:
    """(causal on?, align): ``causal`` may be a bool or an alignment name (the shorthand)."""
    if isinstance(causal, str):
        return True, causal
    return bool(causal), align or "top_left"


def parse_window(window) -> tuple:
    """(left, right) as Python ints or None: ``None`` -> no limit, ``n`` -> ``(n, 0)``."""
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)):
        return int(window), 0
    return tuple(None if w is None else int(w) for w in window)


def _per_batch(x, batch: int):
    """Lengths ``(B,)`` (or one number for every batch item) as a list of Python ints."""
    return [int(n) for n in np.broadcast_to(np.asarray(x), (batch,))]


def _batch(lead) -> int:
    return int(lead[0]) if len(lead) else 1


def offsets(lead, tq, tk, *, causal=False, align=None, kv_lengths=None, q_lengths=None) -> list:
    """``off_b`` for each batch item b: ``i' = i + off_b``."""
    _, align = alignment(causal, align)
    batch = _batch(lead)
    real_k = _per_batch(tk if kv_lengths is None else kv_lengths, batch)
    real_q = _per_batch(tq if q_lengths is None else q_lengths, batch)
    return [nk - nq if align == "bottom_right" else 0 for nk, nq in zip(real_k, real_q)]


def _rule(tq, tk, off, on, left, right, chunk, n_k, n_q) -> np.ndarray:
    """Bool (Tq, Tk) of one batch item, in exact Python-int arithmetic (object arrays)."""
    ip = np.array([i + off for i in range(tq)], dtype=object)[:, None]    # aligned rows i'
    j = np.array(list(range(tk)), dtype=object)[None, :]                  # keys j
    ok = np.ones((tq, tk), bool)
    if on:
        ok &= (j <= ip).astype(bool)
    if left is not None:
        ok &= (j >= ip - left).astype(bool)
    if right is not None:
        ok &= (j <= ip + right).astype(bool)
    if chunk is not None:
        ok &= (ip // chunk == j // chunk).astype(bool)
    ok[:, n_k:] = False
    ok[n_q:, :] = False
    return ok


def allowed(lead, tq, tk, *, causal=False, align=None, window=None, chunk=None, kv_lengths=None,
            q_lengths=None, mask=None) -> np.ndarray:
    """Bool ``(*lead, Tq, Tk)``: may query i (of the leading position) attend to key j?"""
    lead = tuple(lead)
    on, _ = alignment(causal, align)
    left, right = parse_window(window)
    chunk = None if chunk is None else int(chunk)
    batch = _batch(lead)
    n_k = _per_batch(tk if kv_lengths is None else kv_lengths, batch)
    n_q = _per_batch(tq if q_lengths is None else q_lengths, batch)
    offs = offsets(lead, tq, tk, causal=causal, align=align, kv_lengths=kv_lengths, q_lengths=q_lengths)
    ok = np.empty(lead + (tq, tk), bool)
    for b in range(batch):
        rule = _rule(tq, tk, offs[b], on, left, right, chunk, n_k[b], n_q[b])
        if lead:
            ok[b] = rule
        else:
            ok[...] = rule
    if mask is not None:
        ok &= np.asarray(mask, bool)
    return ok


def additive(lead, tq, tk, *, causal=False, align=None, kv_lengths=None, q_lengths=None, bias=None,
             alibi=None, dtype=np.float64) -> np.ndarray:
    """``(*lead, Tq, Tk)`` in ``dtype`` (float64 or wider): ``bias + (-slope[h] · |i' - j|)``."""
    bias_part, alibi_part = _additive_parts(lead, tq, tk, causal, align, kv_lengths, q_lengths, bias, alibi, dtype)
    return bias_part + alibi_part


def _additive_parts(lead, tq, tk, causal, align, kv_lengths, q_lengths, bias, alibi, dtype):
    """The bias and the ALiBi term, each ``(*lead, Tq, Tk)`` (or 0) in ``dtype``."""
    lead = tuple(lead)
    bias_part = np.zeros(lead + (tq, tk), dtype) if bias is None else \
        np.broadcast_to(np.asarray(bias).astype(dtype), lead + (tq, tk))
    alibi_part = np.zeros(lead + (tq, tk), dtype)
    if alibi is not None:
        slopes = np.asarray(alibi).astype(dtype)
        offs = offsets(lead, tq, tk, causal=causal, align=align, kv_lengths=kv_lengths, q_lengths=q_lengths)
        for b, off in enumerate(offs):
            dist = np.abs(np.arange(tq)[:, None] + off - np.arange(tk)[None, :]).astype(dtype)
            s = slopes if slopes.ndim == 1 else slopes[b]                 # (Hq,)
            term = -s[:, None, None] * dist                               # (Hq, Tq, Tk)
            alibi_part[b] += term[b] if len(lead) == 1 else term  # lead (H,): the axis is b and h at once
    return bias_part, alibi_part


# ----------------------------------------------------------------------------- attention
@dataclass
class Solution:
    out: np.ndarray
    lse: np.ndarray
    weights: np.ndarray
    dq: np.ndarray | None = None
    dk: np.ndarray | None = None
    dv: np.ndarray | None = None
    size: dict = field(default_factory=dict)   # Σ|terms| of each result, same shapes
    moved: dict = field(default_factory=dict)  # solve(moved=True): what the scores' rounding moves, / eps


def _sum_to(x: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum ``x`` over the axes broadcasting added or stretched, back to ``shape``."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape)))) if x.ndim > len(shape) else x
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=stretched, keepdims=True) if stretched else x


def _round_into(add: np.ndarray, dtype) -> np.ndarray:
    """The float64 additive term in ``dtype``, saturating at its largest finite value."""
    top = float(np.finfo(dtype).max) if np.dtype(dtype).itemsize < 8 else np.inf
    return np.where(np.isfinite(add), np.clip(add, -top, top), add).astype(dtype)


def _mix64(z):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _fmix32(x):
    x = (x ^ (x >> np.uint32(16))) * np.uint32(0x85EBCA6B)
    x = (x ^ (x >> np.uint32(13))) * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def keep_mask(lead, tq, tk, p: float, seed: int) -> np.ndarray:
    """Bool ``(*lead, Tq, Tk)``: the README's dropout keep-mask (True = kept)."""
    lead = tuple(lead)
    n_batch = int(np.prod(lead[:-1])) if len(lead) >= 2 else 1
    n_head = lead[-1] if lead else 1
    b = np.arange(n_batch, dtype=np.uint64)[:, None, None]
    h = np.arange(n_head, dtype=np.uint64)[None, :, None]
    i = np.arange(tq, dtype=np.uint64)[None, None, :]
    with np.errstate(over="ignore"):
        key = _mix64(_mix64(_mix64(_mix64(np.uint64(int(seed) % 2 ** 64)) + b) + h) + i)[..., None]
        lo = (key % np.uint64(2 ** 32)).astype(np.uint32)
        hi = (key // np.uint64(2 ** 32)).astype(np.uint32)
        col = np.arange(tk, dtype=np.uint32) * np.uint32(0x9E3779B1)
        x = _fmix32((lo ^ col) + hi)
    return (x >= np.uint32(int(p * 2 ** 32))).reshape(lead + (tq, tk))


def solve(q, k, v, dout=None, *, dlse=None, dtype=np.float64, mask=None, bias=None, causal=False, align=None,
          window=None, chunk=None, kv_lengths=None, q_lengths=None, alibi=None, scale=None,
          gqa=False, softcap=None, dropout_p=0.0, dropout_seed=None, moved=False) -> Solution:
    """out, lse, weights (and dq, dk, dv when ``dout`` is given) and their sizes, in ``dtype``.

    ``q (..., Tq, D)``, ``k (..., Tk, D)``, ``v (..., Tk, Dv)``, ``dout (..., Hq, Tq, Dv)``;
    results have the output's leading shape (gradients: their input's shape), in ``dtype``.
    ``dlse (..., Hq, Tq)``: a gradient arriving at lse as well (``∂lse_i/∂s_ij = P_ij``).
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    tq, d = q.shape[-2:]
    tk = k.shape[-2]
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        batch = tuple(np.broadcast_shapes(q.shape[:-3], k.shape[:-3]))
        lead, lead_k = batch + (q.shape[-3],), batch + (k.shape[-3],)
    else:
        group = 1
        lead = lead_k = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2]))

    def whole(x, lead_x, kv):  # x broadcast to lead_x, kv heads repeated, a copy in dtype
        x = np.array(np.broadcast_to(x, lead_x + x.shape[-2:]), dtype=dtype)
        return np.repeat(x, group, axis=-3) if kv and group > 1 else x

    qf, kf, vf = whole(q, lead, False), whole(k, lead_k, True), whole(v, lead_k, True)
    do = None if dout is None else np.array(np.broadcast_to(dout, lead + (tq, v.shape[-1])), dtype=dtype)
    batch_n = _batch(lead)
    n_k = _per_batch(tk if kv_lengths is None else kv_lengths, batch_n)
    n_q = _per_batch(tq if q_lengths is None else q_lengths, batch_n)
    for b in range(batch_n):                          # padding is never read: whatever it holds
        sel = (b,) if lead else ()
        kf[sel][..., n_k[b]:, :] = 0
        vf[sel][..., n_k[b]:, :] = 0
        qf[sel][..., n_q[b]:, :] = 0
        if do is not None:
            do[sel][..., n_q[b]:, :] = 0

    sc = dtype(1.0 / math.sqrt(d) if scale is None else scale)
    ok = allowed(lead, tq, tk, causal=causal, align=align, window=window, chunk=chunk,
                 kv_lengths=kv_lengths, q_lengths=q_lengths, mask=mask)
    wide = np.float64 if np.dtype(dtype).itemsize < 8 else dtype
    parts = _additive_parts(lead, tq, tk, causal, align, kv_lengths, q_lengths, bias, alibi, wide)
    additive_64 = (parts[0] + parts[1]).astype(np.float64)
    with np.errstate(over="ignore"):                   # narrower: each part rounded, added there
        add = _round_into(parts[0], dtype) + _round_into(parts[1], dtype)
    kt = np.swapaxes(kf, -1, -2)
    x = sc * (qf @ kt)                                 # (*L,Tq,D) @ (*L,D,Tk) -> (*L,Tq,Tk)
    slope = 1.0
    if softcap:                                        # c·tanh(x / c), before the additive term
        t = np.tanh(x / dtype(softcap))
        x, slope = dtype(softcap) * t, 1 - t * t
    s = x + add
    s = np.where(ok, s, -np.inf)
    seen = np.isfinite(s).any(axis=-1)                 # (*L, Tq)
    m = np.where(seen, np.max(s, axis=-1), 0)
    e = np.exp(s - m[..., None])                       # exp(-inf) = 0 off the allowed set
    total = np.where(seen, e.sum(axis=-1), 1)
    p = e / total[..., None]
    z = 1.0
    if dropout_p:                                      # P ∘ keep / (1 - p); lse undropped
        z = keep_mask(lead, tq, tk, dropout_p, dropout_seed) / dtype(1 - dropout_p)
    pz = p * z
    out = pz @ vf                                      # (*L,Tq,Tk) @ (*L,Tk,Dv) -> (*L,Tq,Dv)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m + np.log(total), -np.inf).astype(dtype)
    sol = Solution(out, lse, pz)
    with np.errstate(over="ignore", invalid="ignore"):   # sizes: in float64 whatever dtype is
        p64 = p.astype(np.float64)
        terms = abs(float(sc)) * (np.abs(qf) @ np.abs(kt)).astype(np.float64) + np.abs(additive_64)
        spread = np.where(p64 > 0, p64 * terms, 0).sum(axis=-1)    # Σ_j P_ij |terms of s_ij|
        lse_size = np.where(seen, np.abs(lse.astype(np.float64)) + 1 + spread, 0)
    sol.size = {"out": pz @ np.abs(vf), "lse": lse_size, "weights": pz}
    if moved:   # P_ij t_ij, t_ij kept where a mask value does not outweigh it (module docstring)
        t_kept = np.where((p64 > 0) & (terms <= 2.0 ** 23), terms, 0)
        zf, out64, v64 = np.asarray(z, np.float64), np.asarray(out, np.float64), np.asarray(vf, np.float64)
        a2 = (p64 * t_kept) ** 2                       # Δout_i = Σ_j P_ij δ_ij (z_ij v_j - out_i)
        var = (a2 * zf * zf) @ (v64 * v64) - 2 * out64 * ((a2 * zf) @ v64) + out64 * out64 * a2.sum(axis=-1, keepdims=True)
        sol.moved["out"] = np.sqrt(np.maximum(var, 0))
    if do is None:
        return sol

    def back(x, shape):  # a gradient over lead_k (kv heads repeated) summed back to shape
        if group > 1:
            x = x.reshape(x.shape[:-3] + (x.shape[-3] // group, group) + x.shape[-2:]).sum(axis=-3)
        return _sum_to(x, shape)

    dp = z * (do @ np.swapaxes(vf, -1, -2))            # (*L,Tq,Dv) @ (*L,Dv,Tk) -> (*L,Tq,Tk), ∂L/∂P
    delta = (p * dp).sum(axis=-1, keepdims=True)       # rowsum(P ∘ dP) = rowsum(dout ∘ out)
    if dlse is not None:                               # lse_i = log Σ_j exp(s_ij): adds dlse_i P_ij
        delta = delta - np.where(seen, np.broadcast_to(dlse, lead + (tq,)), 0).astype(dtype)[..., None]
    ds = p * (dp - delta) * slope                      # through the softcap: ∂s/∂x = 1 - tanh²
    pt = np.swapaxes(pz, -1, -2)
    sol.dq = _sum_to(sc * (ds @ kf), q.shape)          # (*L,Tq,Tk) @ (*L,Tk,D) -> (*L,Tq,D)
    sol.dk = back(sc * (np.swapaxes(ds, -1, -2) @ qf), k.shape)   # (*L,Tk,Tq) @ (*L,Tq,D)
    sol.dv = back(pt @ do, v.shape)                    # (*L,Tk,Tq) @ (*L,Tq,Dv) -> (*L,Tk,Dv)
    with np.errstate(over="ignore", invalid="ignore"):
        dp_size = z * (np.abs(do) @ np.abs(np.swapaxes(vf, -1, -2)))  # Σ|terms| of dP
        t = abs(sc) * p * (dp_size + (p * dp_size).sum(axis=-1, keepdims=True))   # of dS
        if dlse is not None:
            t = t + abs(sc) * p * np.abs(np.broadcast_to(dlse, lead + (tq,))).astype(dtype)[..., None]
    sol.size.update(dq=_sum_to(t @ np.abs(kf), q.shape), dk=back(np.swapaxes(t, -1, -2) @ np.abs(qf), k.shape),
                    dv=back(pt @ np.abs(do), v.shape))
    if moved:
        with np.errstate(over="ignore", invalid="ignore"):
            sol.moved.update(_moved_grads(p64, zf, t_kept, np.asarray(dp, np.float64), np.asarray(delta, np.float64),
                                          np.asarray(slope, np.float64), float(sc), np.asarray(qf, np.float64),
                                          np.asarray(kf, np.float64), np.asarray(do, np.float64), (q.shape, k.shape, v.shape), back))
    return sol


def _moved_grads(p, z, t, dp, delta, slope, sc, qf, kf, do, shapes, back) -> dict:
    """``moved`` of dq, dk, dv (module docstring): first order in the scores' roundings
    ``δ_il`` (independent, ``|δ_il| ~ t_il``), root-sum-square. ``ΔP_ij = P_ij (δ_ij - δ̄_i)``,
    ``δ̄_i = Σ_l P_il δ_il``; ``dS_ij = s'_ij P_ij G_ij``, ``G = dP - D``, moves by
    ``s'_ij P_ij [δ_ij G_ij - Σ_l P_il δ_il (G_ij + H_il)]``, ``H = dP - rowsum(P dP)``."""
    t2p2 = (t * p) ** 2
    R = t2p2.sum(axis=-1, keepdims=True)               # Σ_l t_il² P_il²
    G = dp - delta
    H = dp - (p * dp).sum(axis=-1, keepdims=True)
    pz = p * z                                         # dv_j = Σ_i z_ij P_ij dout_i
    w = np.maximum(t * t * (1 - 2 * p) + R, 0)         # Σ_l t_il² (1[l=j] - P_il)²
    q_shape, k_shape, v_shape = shapes
    dv = back(np.swapaxes(pz * pz * w, -1, -2) @ (do * do), v_shape)
    A = slope * p * G                                  # dS / s'... coefficients, per (i, j)
    # dq_i: the coefficient of δ_il is sc [A_il k_l - P_il (U_i + H_il W_i)], U = A k, W = (s' P) k
    U, W = A @ kf, (slope * p) @ kf
    t2 = t * t
    var_q = ((t2 * A * A) @ (kf * kf) + U * U * R + W * W * (t2p2 * H * H).sum(axis=-1, keepdims=True)
             - 2 * U * ((t2 * A * p) @ kf) - 2 * W * ((t2 * A * p * H) @ kf) + 2 * U * W * (t2p2 * H).sum(axis=-1, keepdims=True))
    # dk_l: Σ_i q_i² Σ_m t_im² c_{il,m}², c_{il,m} = s'_il P_il [1[m=l] G_il - P_im (G_il + H_im)]
    e = (slope * p) ** 2 * (t2 * G * G - 2 * t2 * G * p * (G + H) + G * G * R
                            + 2 * G * (t2p2 * H).sum(axis=-1, keepdims=True) + (t2p2 * H * H).sum(axis=-1, keepdims=True))
    var_k = np.swapaxes(np.maximum(e, 0), -1, -2) @ (qf * qf)
    return {"dq": abs(sc) * np.sqrt(np.maximum(_sum_to(var_q, q_shape), 0)),
            "dk": abs(sc) * np.sqrt(np.maximum(back(var_k, k_shape), 0)), "dv": np.sqrt(np.maximum(dv, 0))}


def attention(q, k, v, *, dtype=np.float64, **options):
    """``(out, lse, weights)`` of ``qkv.attention`` with ``options``, in ``dtype``."""
    sol = solve(q, k, v, dtype=dtype, **options)
    return sol.out, sol.lse, sol.weights


def attention_grad(dout, q, k, v, *, dtype=np.float64, **options):
    """``(dq, dk, dv)`` of ``qkv.attention_backward`` with ``options``, in ``dtype``."""
    sol = solve(q, k, v, dout, dtype=dtype, **options)
    return sol.dq, sol.dk, sol.dv


# ----------------------------------------------------------------------------- layers
def rope(x, positions, *, base=10000.0, sign=1.0, dtype=np.float64):
    """RoPE of ``x (..., T, D)``: pair ``(x_i, x_{i+D/2})`` rotated by ``sign · p_t · theta_i``,
    ``theta_i = base^(-2i/D)`` (the angles in float64, then in ``dtype``)."""
    d = x.shape[-1]
    theta = float(base) ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angle = np.asarray(positions, np.float64)[:, None] * theta[None, :]    # (T, D/2)
    cos, sin = np.cos(angle).astype(dtype), (sign * np.sin(angle)).astype(dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def alibi_slopes(n: int) -> np.ndarray:
    """Press et al.: for n a power of two ``2^(-8k/n)``, k = 1..n; else those of the power of
    two p below n, then every other slope of 2p, the first n - p of them."""
    def power(m):
        return np.array([2.0 ** (-8.0 * i / m) for i in range(1, m + 1)])
    p = 2 ** int(math.floor(math.log2(n)))
    return power(n) if p == n else np.concatenate([power(p), power(2 * p)[0::2][: n - p]])


def _split(x, heads):   # (B, T, H*D) -> (B, H, T, D)
    b, t, hd = x.shape
    return x.reshape(b, t, heads, hd // heads).transpose(0, 2, 1, 3)


def _merge(x):          # (B, H, T, D) -> (B, T, H*D)
    b, h, t, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * d)


def _flat(x):
    return x.reshape(-1, x.shape[-1])


@dataclass
class LayerSolution:
    y: np.ndarray
    dx: np.ndarray
    dcontext: np.ndarray | None
    grads: dict                                  # parameter name -> gradient
    size: dict                                   # "y", "dx", "dcontext", "d<param>" -> Σ|terms|


def _rope_size(s):
    """A bound on |RoPE(x)| from a bound on |x|: each output mixes its pair with |cos|, |sin| <= 1."""
    d = s.shape[-1]
    both = s[..., : d // 2] + s[..., d // 2:]
    return np.concatenate([both, both], axis=-1)


def mha(params, x, dy, *, n_heads, n_kv_heads, context=None, rope_on=False, rope_base=10000.0,
        alibi=False, dtype=np.float64, **options) -> LayerSolution:
    """Forward and backward of ``qkv.nn.MultiHeadAttention`` as its docstring defines it:
    ``q = split(x W_Q + b_Q)`` etc., RoPE on q and k at positions 0.. (each sequence from 0),
    attention (gqa, the layer's options, ALiBi slopes of Press et al.),
    ``y = merge(o) W_O + b_O``; then the same backwards. ``params`` are the layer's arrays.
    Sizes: each step's Σ|terms| from the attention's own sizes onwards."""
    P = {name: np.asarray(val, dtype) for name, val in params.items()}
    A = {name: np.abs(val).astype(np.float64) for name, val in P.items()}
    x = np.asarray(x, dtype)
    src = x if context is None else np.asarray(context, dtype)
    dy = np.asarray(dy, dtype)

    def proj(inp, name):
        out = inp @ P[f"W_{name}"]
        return out + P[f"b_{name}"] if f"b_{name}" in P else out

    def bias_size(name):
        return A.get(f"b_{name}", 0.0)

    q = _split(proj(x, "Q"), n_heads)                  # (B, Hq, T, D)
    k = _split(proj(src, "K"), n_kv_heads)             # (B, Hkv, Tk, D)
    v = _split(proj(src, "V"), n_kv_heads)
    if rope_on:
        q = rope(q, np.arange(q.shape[-2]), base=rope_base, dtype=dtype)
        k = rope(k, np.arange(k.shape[-2]), base=rope_base, dtype=dtype)
    if alibi:
        options["alibi"] = alibi_slopes(n_heads)
    do = _split(dy @ P["W_O"].T, n_heads)              # (B,T,d_model) @ (d_model,Hq*D) -> (B,Hq,T,D)
    sol = solve(q, k, v, do, dtype=dtype, gqa=True, **options)
    merged = _merge(sol.out)                           # (B, T, Hq*D)
    y = proj(merged, "O")
    s_merged, a_dy = _merge(sol.size["out"]), np.abs(dy).astype(np.float64)
    size = {"y": s_merged @ A["W_O"] + bias_size("O"), "dW_O": _flat(s_merged).T @ _flat(a_dy)}
    grads = {"W_O": _flat(merged).T @ _flat(dy)}
    if "b_O" in P:
        grads["b_O"], size["db_O"] = _flat(dy).sum(axis=0), _flat(a_dy).sum(axis=0)
    dq, dk, dv = sol.dq, sol.dk, sol.dv
    sq, sk, sv = sol.size["dq"], sol.size["dk"], sol.size["dv"]
    if rope_on:
        dq = rope(dq, np.arange(q.shape[-2]), base=rope_base, sign=-1.0, dtype=dtype)
        dk = rope(dk, np.arange(k.shape[-2]), base=rope_base, sign=-1.0, dtype=dtype)
        sq, sk = _rope_size(sq), _rope_size(sk)
    parts = {"Q": (x, _merge(dq), _merge(sq)), "K": (src, _merge(dk), _merge(sk)), "V": (src, _merge(dv), _merge(sv))}
    back = {}
    for name, (inp, g, sg) in parts.items():
        grads[f"W_{name}"] = _flat(inp).T @ _flat(g)
        size[f"dW_{name}"] = _flat(np.abs(inp).astype(np.float64)).T @ _flat(sg)
        if f"b_{name}" in P:
            grads[f"b_{name}"], size[f"db_{name}"] = _flat(g).sum(axis=0), _flat(sg).sum(axis=0)
        back[name] = (g @ P[f"W_{name}"].T, sg @ A[f"W_{name}"].T)
    dx, dsrc = back["Q"][0], back["K"][0] + back["V"][0]
    s_dx, s_dsrc = back["Q"][1], back["K"][1] + back["V"][1]
    if context is None:
        return LayerSolution(y, dx + dsrc, None, grads, dict(size, dx=s_dx + s_dsrc))
    return LayerSolution(y, dx, dsrc, grads, dict(size, dx=s_dx, dcontext=s_dsrc))


def self_attention(params, x, dy, *, causal=False, dtype=np.float64) -> LayerSolution:
    """Forward and backward of ``qkv.nn.SelfAttention``: ``y = attention(x W_Q, x W_K, x W_V)``
    on any leading axes; ``dx = dQ W_Qᵀ + dK W_Kᵀ + dV W_Vᵀ``."""
    P = {name: np.asarray(val, dtype) for name, val in params.items()}
    x, dy = np.asarray(x, dtype), np.asarray(dy, dtype)
    q, k, v = x @ P["W_Q"], x @ P["W_K"], x @ P["W_V"]
    sol = solve(q, k, v, dy, dtype=dtype, causal=causal)
    ax = np.abs(x).astype(np.float64)
    named = list(zip("QKV", (sol.dq, sol.dk, sol.dv), (sol.size["dq"], sol.size["dk"], sol.size["dv"])))
    grads = {f"W_{n}": _flat(x).T @ _flat(g) for n, g, _ in named}
    size = {f"dW_{n}": _flat(ax).T @ _flat(s) for n, _, s in named}
    dx = sum(g @ P[f"W_{n}"].T for n, g, _ in named)
    size["dx"] = sum(s @ np.abs(P[f"W_{n}"]).T.astype(np.float64) for n, _, s in named)
    size["y"] = sol.size["out"]
    return LayerSolution(sol.out, dx, None, grads, size)
