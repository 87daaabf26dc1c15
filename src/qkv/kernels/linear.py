"""Linear attention (Katharopoulos et al., 2020, "Transformers are RNNs"): softmax's
``exp(q·k)`` replaced by a product of feature maps, so attention costs O(T·D·Dv), not O(T²·D).

**The form.** With the feature map ``φ(x) = elu(x) + 1`` (``x + 1`` for ``x > 0``,
``exp(x)`` otherwise: positive, so every weight and every denominator is positive)::

    out_i = Σ_j (φ(q_i)·φ(k_j)) v_j / Σ_j φ(q_i)·φ(k_j)        (j <= i' when causal)

and no ``1/√D``: the scale of the features is learned through the projections. Write
``a = φ(Q)``, ``b = φ(K)`` and ``u = [V | 1]`` (a column of ones makes the denominator
one more output column, ``E = Dv + 1``). Then every row is a product with one matrix::

    y_i   = Σ_j (a_i·b_j) u_j = a_i S,     S = Σ_j b_jᵀ u_j      (D, E): the *state*
    out_i = y_i[:Dv] / y_i[Dv]

**Non-causal**: S once, ``y = a S``: O(T·D·E) time, O(D·E) beyond the inputs.

**Causal in chunks** of C rows. For a row t of chunk c::

    y_t = a_t S_<c  +  Σ_{s in c, s <= t} (a_t·b_s) u_s

the first term through the state ``S_<c`` of all earlier chunks, the second a masked
``(C, C)`` product. Time O(T·(C + E)·D), memory O(T·(C + E)): never a ``(T, T)`` array.

**Decoding** is the causal form one row at a time: ``S <- S + b_tᵀ u_t``, ``y_t = a_t S``;
the state has the constant size ``D·E`` whatever the context length (a KV cache grows by
``2·D`` a token).

**Alignment.** A causal query ``i`` sees keys ``j <= i' = i + offset`` (offset 0 for
top-left, ``Tk - Tq`` for bottom-right). Keys and queries are laid on one timeline of
``L`` rows: key ``j`` on row ``j + p``, query ``i`` on row ``i + offset + p`` with
``p = max(0, -offset)``; a row without a query has ``a = 0`` (its output is dropped), a
row without a key ``b = u = 0`` (it adds nothing). A query that sees no key gets
``y = 0``: output 0 and gradient 0, as in :func:`qkv.attention`.

**Accumulating the state.** ``S`` is a sum over all T keys and its last column
``Σ_j φ(k_j)`` grows like T. Added chunk after chunk in float32, each addition rounds,
and the error of the running sum grows with the number of additions. Here every sum of
chunk states is *compensated* (Kahan): the rounding error of each addition is kept in a
second array and subtracted from the next term, so the state stays accurate to a few
ulp whatever T (at T = 65536 float32 against float64: see tests/attention/test_linear.py).

**Backward.** With ``g_i = ∂L/∂y_i = [dout_i / den_i, -(dout_i·out_i) / den_i]``
(``den_i = y_i[Dv]``; the quotient rule) the three gradients are sums of the same kind,
two of them running backwards in time when causal::

    da_i = Σ_{j <= i} (g_i·u_j) b_j         = g_i S_<iᵀ  + in-chunk part
    db_j = Σ_{i >= j} (u_j·g_i) a_i         = u_j R_>jᵀ  + in-chunk part
    du_j = Σ_{i >= j} (b_j·a_i) g_i         = b_j R_>j   + in-chunk part

with the forward's prefix states ``S_<c`` and one backward-running state
``R_>c = Σ_{i in later chunks} a_iᵀ g_i`` (also compensated). The in-chunk parts reuse the
forward's masked scores ``M∘(a bᵀ)`` and one more masked product ``M∘(g uᵀ)``. Then
``dq = da ∘ φ'(q)``, ``dk = db ∘ φ'(k)``, ``dv = du[:, :Dv]`` with ``φ'(x) = exp(min(x, 0))``.
Without causal the sums run over all rows and the states are totals.

**Heads.** Arrays arrive as in :mod:`qkv.kernels.reference` (``q (*L, Tq, D)``,
``k (*Lk, Tk, D)``, ``group`` query heads per kv head). Inside, q is viewed as
``(*Lk, G, Tq, D)`` and k, v as ``(*Lk, 1, Tk, ·)``, so a kv head's state serves its G
query heads without a copy; gradients of k and v sum over the G axis.
"""
from __future__ import annotations

import numpy as np

CHUNK = 64          # rows per chunk of the causal product (the masked (C, C) products)
SUM_CHUNK = 1024    # rows per partial state when only the total is needed (non-causal)


def feature(x: np.ndarray) -> np.ndarray:
    """``φ(x) = elu(x) + 1``: ``x + 1`` for ``x > 0``, ``exp(x)`` otherwise (never overflows)."""
    e = np.exp(np.minimum(x, 0))
    e += np.maximum(x, 0)
    return e


def feature_grad(x: np.ndarray) -> np.ndarray:
    """``φ'(x) = exp(min(x, 0))``: 1 for ``x > 0``, ``exp(x)`` otherwise."""
    return np.exp(np.minimum(x, 0))


# --- compensated sums of states ---------------------------------------------------------------

def compensated_add(s: np.ndarray, comp: np.ndarray, term: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One Kahan step: ``s + term`` with the running error ``comp`` (true sum ≈ ``s - comp``)."""
    y = term - comp
    t = s + y
    return t, (t - s) - y


def _prefix(ds: np.ndarray, state) -> tuple[np.ndarray, tuple]:
    """Exclusive prefix sums over axis -3 of ``ds (*, n, D, E)``, starting from ``state``.

    Returns ``prefix (*, n, D, E)`` (``prefix[c] = state + Σ_{c' < c} ds[c']``) and the
    final ``(s, comp)``. ``state`` is None or ``(s, comp)``, each broadcasting to ``(*, D, E)``.
    """
    n = ds.shape[-3]
    shape = ds.shape[:-3] + ds.shape[-2:]
    if state is None:
        s, comp = np.zeros(shape, ds.dtype), np.zeros(shape, ds.dtype)
    else:
        s = np.broadcast_to(state[0], shape).astype(ds.dtype)  # a fresh copy either way
        comp = np.broadcast_to(state[1], shape).astype(ds.dtype)
    prefix = np.empty_like(ds)
    for c in range(n):
        prefix[..., c, :, :] = s - comp
        if c == 0 and state is None:
            s = ds[..., 0, :, :].copy()  # 0 + ds[0] is exact: nothing to compensate yet
        else:
            s, comp = compensated_add(s, comp, ds[..., c, :, :])
    return prefix, (s, comp)


def _chunks(x: np.ndarray, c: int) -> np.ndarray:
    """``(*, T, F) -> (*, n, c, F)``, zero rows appended to a multiple of c (they add nothing)."""
    t = x.shape[-2]
    n = -(-t // c)
    if n * c != t:
        pad = [(0, 0)] * (x.ndim - 2) + [(0, n * c - t), (0, 0)]
        x = np.pad(x, pad)
    return x.reshape(x.shape[:-2] + (n, c, x.shape[-1]))


def state_sum(b: np.ndarray, u: np.ndarray, state=None, chunk: int = SUM_CHUNK) -> tuple:
    """``state + Σ_t b_tᵀ u_t`` for ``b (*, T, D)``, ``u (*, T, E)``, compensated over chunks.

    Returns ``(s, comp)`` of shape ``(*, D, E)``.
    """
    c = max(1, min(chunk, b.shape[-2]))
    ds = _swap(_chunks(b, c)) @ _chunks(u, c)  # (*,n,D,c) @ (*,n,c,E) -> (*,n,D,E)
    return _prefix(ds, state)[1]


def _swap(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


def _unchunk(x: np.ndarray, t: int) -> np.ndarray:
    """``(*, n, c, F) -> (*, t, F)``: the inverse of :func:`_chunks`."""
    return x.reshape(x.shape[:-3] + (-1, x.shape[-1]))[..., :t, :]


def _causal_parts(a, b, u, state, chunk: int) -> dict:
    """The chunked forward: ``ac, bc, uc (*, n, c, ·)``, the prefix states ``S_<c``, the
    masked in-chunk scores, ``y (*, n, c, E)`` and the final state."""
    c = max(1, min(chunk, a.shape[-2]))
    ac, bc, uc = _chunks(a, c), _chunks(b, c), _chunks(u, c)  # (*, n, c, ·)
    ds = _swap(bc) @ uc  # (*,n,D,c) @ (*,n,c,E) -> (*,n,D,E): each chunk's state
    prefix, final = _prefix(ds, state)  # S_<c for every chunk c
    y = ac @ prefix  # (*,n,c,D) @ (*,n,D,E) -> (*,n,c,E): what the earlier chunks give
    tri = np.tri(c, dtype=ac.dtype)  # s <= t inside the chunk
    scores = ac @ _swap(bc)  # (*,n,c,D) @ (*,n,D,c) -> (*,n,c,c)
    scores *= tri
    y += scores @ uc  # (*,n,c,c) @ (*,n,c,E) -> (*,n,c,E): the chunk itself
    return dict(ac=ac, bc=bc, uc=uc, prefix=prefix, tri=tri, scores=scores, y=y, final=final)


def causal_product(a: np.ndarray, b: np.ndarray, u: np.ndarray, state=None,
                   chunk: int = CHUNK) -> tuple[np.ndarray, tuple]:
    """``y_t = a_t (S0 + Σ_{s <= t} b_sᵀ u_s)`` for every row t, in chunks (see the module docstring).

    ``a (*, T, D)``, ``b (*, T, D)``, ``u (*, T, E)`` (leading axes broadcast);
    ``state`` None or ``(s, comp)`` broadcasting to ``(*, D, E)``: ``S0 = s - comp``.
    Returns ``y (*, T, E)`` and the state after the last row, ``(s, comp)``.
    """
    parts = _causal_parts(a, b, u, state, chunk)
    return _unchunk(parts["y"], a.shape[-2]), parts["final"]


def _causal_grads(parts: dict, gc: np.ndarray) -> tuple:
    """``(da, db, du)`` chunked, from the forward's parts and ``gc = ∂L/∂y`` chunked ``(*, G, n, c, E)``.

    In a chunk: ``da = g S_<cᵀ + (M∘g uᵀ) b``, ``db = u R_>cᵀ + (M∘g uᵀ)ᵀ a`` and
    ``du = b R_>c + (M∘a bᵀ)ᵀ g``, where ``R_>c = Σ_{later chunks} aᵀ g`` (summed over the
    G query heads) is the backward-running state and M the in-chunk causal mask.
    """
    ac, bc, uc, tri = parts["ac"], parts["bc"], parts["uc"], parts["tri"]
    gu = gc @ _swap(uc)  # (*,G,n,c,E) @ (*,1,n,E,c) -> (*,G,n,c,c): g_t·u_s
    gu *= tri
    da = gc @ _swap(parts["prefix"])  # (*,G,n,c,E) @ (*,1,n,E,D) -> (*,G,n,c,D)
    da += gu @ bc  # (*,G,n,c,c) @ (*,1,n,c,D) -> (*,G,n,c,D)
    dr = np.sum(_swap(ac) @ gc, axis=-4, keepdims=True)  # (*,G,n,D,c) @ (*,G,n,c,E) -> (*,1,n,D,E)
    suffix = _prefix(dr[..., ::-1, :, :], None)[0][..., ::-1, :, :]  # R_>c
    db = uc @ _swap(suffix)  # (*,1,n,c,E) @ (*,1,n,E,D) -> (*,1,n,c,D)
    db = db + np.sum(_swap(gu) @ ac, axis=-4, keepdims=True)  # (*,G,n,c,c) @ (*,G,n,c,D), over G
    du = bc @ suffix  # (*,1,n,c,D) @ (*,1,n,D,E) -> (*,1,n,c,E)
    du = du + np.sum(_swap(parts["scores"]) @ gc, axis=-4, keepdims=True)  # (*,G,n,c,c) @ (*,G,n,c,E)
    return da, db, du


# --- the attention problem -------------------------------------------------------------------

def _grouped(q: np.ndarray, group: int) -> np.ndarray:
    """``(*L, Tq, D) -> (*Lk, G, Tq, D)``: query heads ``h*G .. h*G+G-1`` under kv head h."""
    if group == 1:
        return q[..., None, :, :]
    return q.reshape(q.shape[:-3] + (q.shape[-3] // group, group) + q.shape[-2:])


def _ones_column(v: np.ndarray) -> np.ndarray:
    """``[v | 1]``: ``(*, T, Dv) -> (*, T, Dv + 1)``."""
    ones = np.ones(v.shape[:-1] + (1,), dtype=v.dtype)
    return np.concatenate([np.broadcast_to(v, v.shape), ones], axis=-1)


def _place(x: np.ndarray, start: int, length: int) -> np.ndarray:
    """``x (*, T, F)`` on rows ``start .. start+T-1`` of ``length`` zero rows."""
    if start == 0 and x.shape[-2] == length:
        return x
    out = np.zeros(x.shape[:-2] + (length, x.shape[-1]), dtype=x.dtype)
    out[..., start:start + x.shape[-2], :] = x
    return out


def timeline(tq: int, tk: int, offset: int) -> tuple[int, int, int]:
    """``(p, r, L)``: key j on row ``j + p``, query i on row ``i + r``, ``L`` rows in all."""
    p = max(0, -offset)
    r = offset + p
    return p, r, max(tk + p, tq + r)


def _normalise(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(out, den)`` from ``y = [num | den]``; a row with ``den = 0`` (it saw nothing) gives 0."""
    den = y[..., -1:]
    safe = np.where(den > 0, den, 1)
    return np.where(den > 0, y[..., :-1] / safe, 0), den


def _features(q, k, v, group):
    """``a = φ(q) (*Lk, G, Tq, D)``, ``b = φ(k) (*Lk, 1, Tk, D)``, ``u = [v | 1] (*Lk, 1, Tk, E)``."""
    a = feature(_grouped(q, group))  # (*Lk, G, Tq, D)
    b = feature(k)[..., None, :, :]  # (*Lk, 1, Tk, D)
    u = _ones_column(v)[..., None, :, :]  # (*Lk, 1, Tk, E)
    return a, b, u


def _products(a, b, u, causal: bool, offset: int, state):
    """``y (*Lk, G, Tq, E)`` and the final state of the forward products."""
    if not causal:
        s = state_sum(b, u, state)
        return a @ (s[0] - s[1]), s  # (*,G,Tq,D) @ (*,1,D,E) -> (*,G,Tq,E)
    tq, tk = a.shape[-2], b.shape[-2]
    p, r, length = timeline(tq, tk, offset)
    y, s = causal_product(_place(a, r, length), _place(b, p, length), _place(u, p, length), state)
    return y[..., r:r + tq, :], s


def forward(q, k, v, *, causal: bool = False, offset: int = 0, group: int = 1, state=None):
    """Linear attention. ``q (*L, Tq, D)``, ``k (*Lk, Tk, D)``, ``v (*Lk, Tk, Dv)`` in the
    compute dtype; ``offset`` aligns a causal query (``i' = i + offset``); ``state`` (causal
    only) is ``(s, comp)`` ``(*Lk, 1, D, Dv+1)`` of keys before these, seen by every query.

    Returns ``out (*L, Tq, Dv)`` and the state after all keys, ``(s, comp)``.
    """
    a, b, u = _features(q, k, v, group)
    y, s = _products(a, b, u, causal, offset, state)
    out, _ = _normalise(y)
    return out.reshape(q.shape[:-1] + (v.shape[-1],)), s


def _grad_y(dout, out, den, group):
    """``g = ∂L/∂y = [dout / den, -(dout·out) / den]`` ``(*Lk, G, Tq, E)``; 0 on rows that saw nothing."""
    do = _grouped(dout, group)  # (*Lk, G, Tq, Dv)
    g = np.concatenate([do, -np.sum(do * out, axis=-1, keepdims=True)], axis=-1)
    return np.where(den > 0, g / np.where(den > 0, den, 1), 0)


def backward(dout, q, k, v, *, causal: bool = False, offset: int = 0, group: int = 1, state=None):
    """``(dq, dk, dv)`` of :func:`forward` from ``dout (*L, Tq, Dv)``; the keys behind
    ``state`` are constants. Recomputes the forward products (nothing is saved)."""
    a, b, u = _features(q, k, v, group)
    tq, tk = q.shape[-2], k.shape[-2]
    if not causal:
        s = state_sum(b, u, state)
        total = s[0] - s[1]  # (*, 1, D, E)
        out, den = _normalise(a @ total)  # (*,G,Tq,D) @ (*,1,D,E) -> (*,G,Tq,E)
        g = _grad_y(dout, out, den, group)
        da = g @ _swap(total)  # (*,G,Tq,E) @ (*,1,E,D) -> (*,G,Tq,D)
        r = state_sum(a, g)
        r = np.sum(r[0] - r[1], axis=-3, keepdims=True)  # Σ_i a_iᵀ g_i over the G heads: (*,1,D,E)
        db = u @ _swap(r)  # (*,1,Tk,E) @ (*,1,E,D) -> (*,1,Tk,D)
        du = b @ r  # (*,1,Tk,D) @ (*,1,D,E) -> (*,1,Tk,E)
    else:
        p, r0, length = timeline(tq, tk, offset)
        parts = _causal_parts(_place(a, r0, length), _place(b, p, length), _place(u, p, length), state, CHUNK)
        out, den = _normalise(_unchunk(parts["y"], length)[..., r0:r0 + tq, :])
        gc = _chunks(_place(_grad_y(dout, out, den, group), r0, length), parts["ac"].shape[-2])
        da, db, du = _causal_grads(parts, gc)
        da = _unchunk(da, length)[..., r0:r0 + tq, :]
        db = _unchunk(db, length)[..., p:p + tk, :]
        du = _unchunk(du, length)[..., p:p + tk, :]
    dq = (da * feature_grad(_grouped(q, group))).reshape(q.shape)
    dk = db[..., 0, :, :] * feature_grad(k)
    dv = du[..., 0, :, :-1]
    return dq, dk, np.ascontiguousarray(dv)


def weights(q, k, *, causal: bool = False, offset: int = 0, group: int = 1) -> np.ndarray:
    """The weights ``φ(q_i)·φ(k_j) / Σ_j φ(q_i)·φ(k_j)`` as a dense ``(*L, Tq, Tk)`` array,
    for looking at (the forward never makes it). Rows that see nothing are 0."""
    a = feature(_grouped(q, group))  # (*Lk, G, Tq, D)
    b = feature(k)[..., None, :, :]  # (*Lk, 1, Tk, D)
    w = a @ np.swapaxes(b, -1, -2)  # (*,G,Tq,D) @ (*,1,D,Tk) -> (*,G,Tq,Tk)
    if causal:
        i = np.arange(q.shape[-2])[:, None] + offset
        w = np.where(np.arange(k.shape[-2])[None, :] <= i, w, 0)
    total = np.sum(w, axis=-1, keepdims=True)
    w = np.where(total > 0, w / np.where(total > 0, total, 1), 0)
    return w.reshape(q.shape[:-1] + (k.shape[-2],))
