"""What is done to a score or a weight beside the mask: logit softcapping and the dropout keep-mask.

**Softcap** ``c`` (Gemma 2's ``attn_logit_softcapping``, flash-attn's ``softcap``): the scaled
score ``x = scale·q·k`` becomes ``s = c·tanh(x / c)``, bounded by ``±c``, before the bias,
ALiBi and the masks. Its derivative is ``ds/dx = 1 - tanh²(x / c) = 1 - (s / c)²``, so the
backward multiplies ``dS`` by it before the products with K and Q.

**Dropout** ``p`` with ``seed``: after the softmax the weights ``P`` become ``P ∘ Z`` with
``Z_ij = keep_ij / (1 - p)``; ``lse`` is the undropped one. ``keep`` is a counter-based
function of (seed, batch, head, query row, key column), so a kernel draws any tile of it
alone and the backward draws the same tile again instead of storing it; tile sizes, threads,
kernels and the ring's blocks all see one mask. With ``mix64`` splitmix64's finaliser and
``fmix32`` murmur3's (both bijections; all arithmetic mod ``2^64`` or ``2^32``)::

    key  = mix64(mix64(mix64(mix64(seed) + batch) + head) + row)        one per query row
    x    = fmix32(((key mod 2^32) XOR (column · 0x9E3779B1)) + ⌊key / 2^32⌋)
    keep = x >= ⌊p · 2^32⌋

``batch`` is the flat index of the leading axes before the head axis (0 without them),
``head`` the query head (0 without a head axis), ``row`` and ``column`` the positions in
the whole sequence (a ring rank's block counts from its global start). A kept entry's
chance is ``1 - ⌊p · 2^32⌋ / 2^32`` (within ``2^-32`` of ``1 - p``). Per element the mask
costs one 32-bit product for the column, two in ``fmix32`` and a few shifts: the compiled
passes draw it inside the tile's exponential pass.
"""
from __future__ import annotations

import numpy as np

M64 = (1 << 64) - 1
GOLDEN32 = np.uint32(0x9E3779B1)
_U64 = np.uint64


def softcap(x: np.ndarray, c: float) -> np.ndarray:
    """``c·tanh(x / c)`` in place on the float array ``x`` (returned)."""
    t = x.dtype.type
    np.divide(x, t(c), out=x)
    np.tanh(x, out=x)
    np.multiply(x, t(c), out=x)
    return x


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic)."""
    z = z ^ (z >> _U64(30))
    z = z * _U64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> _U64(27))
    z = z * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def fmix32(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser on uint32 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def row_keys(seed: int, batch, head, rows) -> np.ndarray:
    """``key`` (uint64) of each query row; ``batch``, ``head``, ``rows`` broadcast together."""
    with np.errstate(over="ignore"):
        z = mix64(np.full((), seed & M64, _U64))
        z = mix64(z + np.asarray(batch).astype(_U64))
        z = mix64(z + np.asarray(head).astype(_U64))
        return mix64(z + np.asarray(rows).astype(_U64))


def threshold(p: float) -> int:
    """``⌊p · 2^32⌋``: a 32-bit draw below it drops the weight."""
    return int(p * 2.0 ** 32)


def bits(keys: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """The 32-bit draws ``x`` of rows with ``keys (..., R, 1)`` against columns ``cols (C,)``."""
    lo = (keys & _U64(0xFFFFFFFF)).astype(np.uint32)
    hi = (keys >> _U64(32)).astype(np.uint32)
    c = (np.asarray(cols).astype(np.int64) & 0xFFFFFFFF).astype(np.uint32)
    return fmix32((lo ^ (c * GOLDEN32)) + hi)


def keep_scale(keys: np.ndarray, cols: np.ndarray, p: float, dtype) -> np.ndarray:
    """``Z = keep / (1 - p)`` in ``dtype`` for rows with ``keys (..., R, 1)`` and ``cols (C,)``."""
    z = (bits(keys, cols) >= np.uint32(threshold(p))).astype(dtype)
    z *= np.dtype(dtype).type(1.0 / (1.0 - p))
    return z


# --- a problem's mask, by its spec (qkv.masks.MaskSpec: softcap, dropout_p, dropout_seed, ...) ---------
def head_ids(lead: tuple, index: tuple) -> tuple[int, int]:
    """``(batch, head)`` of one leading position ``index`` of ``lead = (..., Hq)``."""
    if not lead:
        return 0, 0
    batch = int(np.ravel_multi_index(index[:-1], lead[:-1])) if len(lead) >= 2 else 0
    return batch, int(index[-1])


def keys(spec, q0: int, q1: int, index: tuple | None = None) -> np.ndarray:
    """Row keys of rows ``q0:q1`` (local; global rows ``q_start + i``): ``(q1-q0,)`` for one
    leading position ``index``, else ``lead + (q1-q0, 1)``."""
    rows = np.arange(q0, q1, dtype=np.int64) + spec.q_start
    if index is not None:
        return row_keys(spec.dropout_seed, *head_ids(spec.lead, index), rows)
    lead = spec.lead
    if not lead:
        return row_keys(spec.dropout_seed, 0, 0, rows[:, None])
    heads = np.arange(lead[-1]).reshape((lead[-1], 1, 1))
    batch = np.arange(int(np.prod(lead[:-1], dtype=np.int64))).reshape(lead[:-1] + (1, 1, 1))
    return row_keys(spec.dropout_seed, batch, heads, rows[:, None])


def keep(spec, q0: int = 0, q1: int | None = None, k0: int = 0, k1: int | None = None,
         index: tuple | None = None, dtype=np.float64) -> np.ndarray:
    """``Z = keep / (1 - p)`` of rows ``q0:q1`` and keys ``k0:k1``: ``(rows, keys)`` for one
    leading position ``index``, else ``lead + (rows, keys)``."""
    q1 = spec.tq if q1 is None else q1
    k1 = spec.tk if k1 is None else k1
    k = keys(spec, q0, q1, index)
    if index is not None:
        k = k[:, None]
    return keep_scale(k, np.arange(k0, k1, dtype=np.int64) + spec.k_start, spec.dropout_p, dtype)
