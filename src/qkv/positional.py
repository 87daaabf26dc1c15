"""Positional information for attention: sinusoidal tables, RoPE and ALiBi slopes.

Attention by itself is order-blind: permute the keys (with their values) and every output
row is unchanged. Three ways to tell it where tokens are:

**Sinusoidal** (Vaswani et al. 2017, §3.5), added to the embeddings::

    PE[pos, 2i]   = sin(pos / base^(2i / d_model))
    PE[pos, 2i+1] = cos(pos / base^(2i / d_model))        base = 10000

**RoPE** (Su et al. 2021), applied to q and k after their projections. Each pair of
features is rotated by an angle proportional to the position; with the *half-split*
pairing of Llama and GPT-NeoX, feature ``i`` pairs with feature ``i + D/2``::

    theta_i   = base^(-2i / D)                      i = 0 .. D/2 - 1
    x1, x2    = x[..., :D/2], x[..., D/2:]
    rope(x)_p = [x1 cos(p theta) - x2 sin(p theta),  x2 cos(p theta) + x1 sin(p theta)]

Rotations compose, so ``<rope(q)_i, rope(k)_j> = <q, R((j - i) theta) k>``: the score
depends on the positions only through ``i - j``. A rotation is orthogonal, so the
gradient of ``rope`` is the inverse rotation of the incoming gradient
(:func:`rope_backward`). For cached decoding the new tokens sit at positions
``offset, offset + 1, ...``.

**ALiBi** (Press et al. 2022) adds ``-slope_h * |i - j|`` to head h's scores; the slopes
are a geometric sequence (:func:`alibi_slopes`); :func:`qkv.attention` takes them as
``alibi=``.
"""
from __future__ import annotations

import math

import numpy as np

from . import jit
from .errors import ShapeError, as_float_array, fmt_shape, positive_int


def check_base(base, name: str = "base") -> float:
    """``base`` as a finite float > 1, or a ShapeError naming it (the layers pass ``"rope_base"``)."""
    if isinstance(base, bool) or not isinstance(base, (int, float, np.floating, np.integer)) \
            or not math.isfinite(base) or base <= 1:
        raise ShapeError(f"{name} must be a finite number > 1 (default 10000); got {base!r}")
    return float(base)


def sinusoidal(n_positions: int, d_model: int, *, base: float = 10000.0,
               dtype=np.float32) -> np.ndarray:
    """The original transformer's position table ``(n_positions, d_model)``.

    Even columns ``2i`` hold ``sin(pos / base^(2i/d_model))``, odd columns ``2i+1`` the
    cosine at the same frequency (an odd ``d_model`` ends on a sine column).

    >>> sinusoidal(3, 4, dtype=np.float64).round(4)
    array([[ 0.    ,  1.    ,  0.    ,  1.    ],
           [ 0.8415,  0.5403,  0.01  ,  1.    ],
           [ 0.9093, -0.4161,  0.02  ,  0.9998]])
    """
    n_positions = positive_int("n_positions", n_positions)
    d_model = positive_int("d_model", d_model)
    base = check_base(base)
    pos = np.arange(n_positions, dtype=np.float64)[:, None]  # (T, 1)
    two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]  # (1, ceil(D/2))
    angle = pos / base ** (two_i / d_model)  # (T, ceil(D/2))
    table = np.empty((n_positions, d_model), dtype=np.float64)
    table[:, 0::2] = np.sin(angle)
    table[:, 1::2] = np.cos(angle[:, : d_model // 2])
    return table.astype(dtype)


def rope_angles(positions, d_head: int, *, base: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """``(cos, sin)``, each ``(T, d_head/2)``: ``cos(p_t theta_i)`` and ``sin(p_t theta_i)``.

    ``positions`` is an int array ``(T,)``; ``theta_i = base^(-2i/d_head)``. Computed in
    float64 (positions times frequencies lose digits in float32 at long range).
    """
    d_head = positive_int("d_head", d_head)
    if d_head % 2:
        raise ShapeError(f"RoPE needs an even head size d_head; got {d_head}")
    base = check_base(base)
    positions = np.asarray(positions)
    if positions.ndim != 1 or positions.dtype.kind not in "iu":
        raise ShapeError(f"positions must be an int array (T,); got {fmt_shape(positions.shape)} {positions.dtype}")
    theta = base ** (-np.arange(0, d_head, 2, dtype=np.float64) / d_head)  # (D/2,)
    angle = positions.astype(np.float64)[:, None] * theta[None, :]  # (T, 1) * (1, D/2) -> (T, D/2)
    return np.cos(angle), np.sin(angle)


def _rotate(x, positions, offset: int, base: float, sign: float) -> np.ndarray:
    x = as_float_array("x", x)
    if x.ndim < 2:
        raise ShapeError(f"x must have at least 2 dimensions (..., T, D); got {fmt_shape(x.shape)}")
    t, d = x.shape[-2:]
    if positions is None and isinstance(offset, (np.ndarray, list, tuple)):
        return _rotate_per_sequence(x, offset, base, sign)
    if positions is None:
        offset = positive_int("offset", offset, 0)
        positions = np.arange(offset, offset + t)
    else:
        if not (isinstance(offset, (int, np.integer)) and not isinstance(offset, bool) and offset == 0):
            raise ShapeError(f"pass positions= or offset=, not both (offset would be ignored); got positions and offset={offset!r}")
        positions = np.asarray(positions)
        if positions.shape != (t,):
            raise ShapeError(f"positions must have shape (T,) = ({t},); got {fmt_shape(positions.shape)}")
    cos, sin = rope_angles(positions, d, base=base)
    cdt = np.float64 if x.dtype == np.float64 else np.float32
    cos, sin = cos.astype(cdt), (sign * sin).astype(cdt)
    mod = jit.load(jit.ROPE) if x.dtype == cdt and x.size else None
    if mod is not None:                                              # one pass, the same bits
        out = np.empty(x.shape, cdt)
        four = (1,) * (4 - x.ndim) + x.shape[-4:] if x.ndim <= 4 else (-1,) + x.shape[-3:]
        mod.rotate(x.reshape(four), cos, sin, out.reshape(four))     # (B, H, T, D): strided heads read in place
        return out
    x1, x2 = x[..., : d // 2].astype(cdt, copy=False), x[..., d // 2:].astype(cdt, copy=False)
    out = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)  # (..., T, D)
    return out.astype(x.dtype, copy=False)


def _rotate_per_sequence(x, offsets, base: float, sign: float) -> np.ndarray:
    """RoPE of ``x (B, ..., T, D)`` where sequence b starts at ``offsets[b]`` (a ragged KV cache)."""
    offsets = np.asarray(offsets)
    if offsets.dtype.kind not in "iu" or offsets.shape != x.shape[:1] or (offsets < 0).any():
        raise ShapeError(f"offset must be an int >= 0 or ints >= 0 of shape (B,) = ({x.shape[0]},); "
                         f"got {fmt_shape(offsets.shape)} {offsets.dtype}")
    return np.stack([_rotate(x[b], None, int(o), base, sign) for b, o in enumerate(offsets)])


def rope(x, positions=None, *, offset: int = 0, base: float = 10000.0) -> np.ndarray:
    """Rotary position embedding of ``x (..., T, D)`` (half-split pairing, as Llama/NeoX).

    Token t is at ``positions[t]`` if given (int ``(T,)``), else at ``offset + t`` (the
    offset is the number of tokens already in a KV cache; an int array ``(B,)`` gives each
    sequence of ``x (B, ..., T, D)`` its own); give one of the two, not both. ``D`` must be even. Returns an
    array of x's shape and dtype; the rotation is computed in float32 (float64 for float64), with
    the ``fast`` extra in one compiled pass that gives NumPy's bits (:mod:`qkv.kernels.rope_compiled`).

    >>> q = np.array([[1.0, 0.0]])          # one token, D = 2: theta_0 = 1
    >>> rope(q, offset=1).round(4)           # rotated by 1 radian
    array([[0.5403, 0.8415]])
    """
    return _rotate(x, positions, offset, base, 1.0)


def rope_backward(dy, positions=None, *, offset: int = 0, base: float = 10000.0) -> np.ndarray:
    """Gradient through :func:`rope`: the inverse rotation (by ``-p theta``) of ``dy``.

    ``rope`` is ``y = R x`` with ``R`` orthogonal, so ``dx = Rᵀ dy = R⁻¹ dy``. Same
    arguments as :func:`rope`; ``dy (..., T, D)``.
    """
    return _rotate(dy, positions, offset, base, -1.0)


def alibi_slopes(n_heads: int) -> np.ndarray:
    """ALiBi slopes ``(n_heads,)`` float64, following Press et al. (2022).

    For ``n`` a power of two the slopes are the geometric sequence starting and stepping
    at ``2^(-8/n)``: 8 heads give ``1/2, 1/4, ..., 1/256``. For other ``n``, take the
    slopes of the nearest smaller power of two ``p``, then the first ``n - p`` of every
    other slope of ``2p`` (the paper's rule, also in its reference code).

    >>> alibi_slopes(4).tolist()
    [0.25, 0.0625, 0.015625, 0.00390625]
    """
    n_heads = positive_int("n_heads", n_heads)

    def power_of_two(n: int) -> np.ndarray:
        start = 2.0 ** (-8.0 / n)
        return start ** np.arange(1, n + 1, dtype=np.float64)

    p = 2 ** int(math.floor(math.log2(n_heads)))
    if p == n_heads:
        return power_of_two(n_heads)
    return np.concatenate([power_of_two(p), power_of_two(2 * p)[0::2][: n_heads - p]])
