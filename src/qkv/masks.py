"""Every way of saying "query i may (not) look at key j", parsed once into one :class:`MaskSpec`.

The structured options of :func:`qkv.attention` are rules on an *aligned* query position
``i' = i + offset_b`` against the key position ``j``:

- ``align``: ``"top_left"`` (offset 0) or ``"bottom_right"`` (offset ``Tk_b - Tq_b``, where
  ``Tk_b``/``Tq_b`` are batch item b's real lengths: ``kv_lengths[b]``/``q_lengths[b]``, else
  the array lengths). Bottom-right puts the last real query on the last real key: flash-attn's
  convention and the KV-cache one.
- ``causal``: ``j <= i'``.
- ``window=(left, right)``: ``i' - left <= j <= i' + right`` (``None`` on a side: unbounded).
- ``chunk=C``: ``⌊i'/C⌋ = ⌊j/C⌋`` (Llama 4's chunked attention when combined with causal).
- ``kv_lengths`` ``(B,)``: keys ``j >= kv_lengths[b]`` do not exist for batch item b;
  ``q_lengths`` ``(B,)``: query rows ``i >= q_lengths[b]`` are padding and see nothing.
- ``mask``: a bool array, True = may attend, broadcast to ``(..., Hq, Tq, Tk)``.
- ``bias``: a float array added to the scaled scores, same broadcasting.
- ``alibi``: slopes ``(Hq,)`` or ``(B, Hq)``; head h adds ``-slope * |i' - j|``.
- ``softcap``, ``dropout_p``/``dropout_seed``: what is done to a score or a weight beside the
  mask (:mod:`qkv.score_ops`); kept here so that every kernel and the ring's blocks see them.

A kernel asks the spec about one block of rows ``q0:q1`` and columns ``k0:k1`` of one batch
item at a time: :meth:`MaskSpec.segments` says which key runs any row may see and which of
them every row sees (no mask needed), :meth:`MaskSpec.query_range` the transpose,
:meth:`MaskSpec.allowed` gives a block's boolean mask and :meth:`MaskSpec.additive` its
additive bias. No method makes a ``(Tq, Tk)`` array unless asked for the whole range.

Positions are local to the arrays the kernel sees; a kernel that holds one block of a longer
sequence (ring attention) sets ``q_start``/``k_start``, the global positions of its first
query row and first key, so the rules above apply to global positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import OptionError, ShapeError, as_array, broadcasts_to, fmt_shape
from .options import parse_alignment, parse_chunk, parse_dropout, parse_softcap, parse_window

__all__ = ["MaskSpec", "build_spec"]


@dataclass(frozen=True)
class MaskSpec:
    """Which keys each query may attend to, and what is added to its scores.

    ``lead`` is the output's leading shape ``(..., Hq)``; arrays given by the user are kept
    as given (already checked to broadcast to ``lead + (Tq, Tk)``). ``offset`` is the
    alignment offset, an int or one per batch item ``(B,)``.
    """

    lead: tuple
    tq: int
    tk: int
    causal: bool = False
    left: int | None = None
    right: int | None = None
    chunk: int | None = None
    offset: int | np.ndarray = 0
    q_start: int = 0
    k_start: int = 0
    kv_lengths: np.ndarray | None = None
    q_lengths: np.ndarray | None = None
    mask: np.ndarray | None = None
    bias: np.ndarray | None = None
    alibi: np.ndarray | None = None
    softcap: float | None = None   # scores c·tanh(x / c) before bias, ALiBi and masks (qkv.score_ops)
    dropout_p: float = 0.0         # > 0: weights times keep / (1 - p), keep drawn from dropout_seed
    dropout_seed: int = 0

    @property
    def plain_scores(self) -> bool:
        """True when the weights are the softmax of ``scale·q·k + bias`` as they are: no
        ``softcap``, no dropout (``dropout_p == 0``). A kernel that implements neither
        declines a problem where this is False."""
        return self.softcap is None and self.dropout_p == 0

    # --- per batch item ------------------------------------------------------------
    def shift(self, batch: int | None) -> int:
        """``i' - j`` for local row 0 and local key 0 of ``batch`` (any item when None,
        only if the offset is the same for all)."""
        off = self.offset
        if isinstance(off, np.ndarray):
            off = int(off[batch]) if batch is not None else int(off.min(initial=0))
        return off + self.q_start - self.k_start

    def _limit(self, lengths, batch, full: int) -> int:
        """Real length of ``batch`` (the longest over batch items when None)."""
        if lengths is None:
            return full
        return int(lengths[batch]) if batch is not None else int(lengths.max(initial=0))

    def rows(self, batch: int | None = None) -> int:
        """Query rows ``[0, rows)`` that are not padding."""
        return self._limit(self.q_lengths, batch, self.tq)

    def keys(self, batch: int | None = None) -> int:
        """Keys ``[0, keys)`` that exist."""
        return self._limit(self.kv_lengths, batch, self.tk)

    def _uniform(self, batch) -> bool:
        """True when every batch item has the same alignment and lengths (or one is chosen)."""
        if batch is not None:
            return True
        return all(x is None or x.size == 0 or np.ptp(x) == 0
                   for x in (self.kv_lengths, self.q_lengths,
                             self.offset if isinstance(self.offset, np.ndarray) else None))

    # --- structure -----------------------------------------------------------------
    @property
    def band(self) -> tuple:
        """``(lo, hi)``: query i' may see ``i' - lo <= j <= i' + hi`` (None: no limit)."""
        hi = self.right
        if self.causal:
            hi = 0 if hi is None else min(hi, 0)
        return self.left, hi

    @property
    def is_trivial(self) -> bool:
        """True when every query may see every key with no bias."""
        lo, hi = self.band
        return (lo is None and hi is None and self.chunk is None and self.kv_lengths is None
                and self.q_lengths is None and self.mask is None and self.bias is None
                and self.alibi is None)

    def _visible(self, q0, q1, k0, k1, batch):
        """Keys of ``k0:k1`` some row of ``q0:q1`` sees ``(v0, v1)``, and keys all rows see
        ``(f0, f1)`` (empty when ``f0 >= f1``), by band and chunk, in local key indices."""
        lo, hi = self.band
        s = self.shift(batch)
        a, b = q0 + s, q1 - 1 + s                         # first and last row, as key positions
        v0 = k0 if lo is None else max(k0, a - lo)
        v1 = k1 if hi is None else min(k1, b + hi + 1)
        f0 = v0 if lo is None else max(v0, b - lo)
        f1 = v1 if hi is None else min(v1, a + hi + 1)
        if self.chunk is not None:
            c, ks = self.chunk, self.k_start
            first, last = (a + ks) // c, (b + ks) // c    # chunks of the first and last row
            v0, v1 = max(v0, first * c - ks), min(v1, (last + 1) * c - ks)
            if first != last:
                f0, f1 = 0, 0
            else:
                f0, f1 = max(f0, first * c - ks), min(f1, (first + 1) * c - ks)
        return v0, v1, f0, f1

    def segments(self, q0: int, q1: int, k0: int, k1: int, batch: int | None = None) -> list:
        """The keys of ``k0:k1`` that rows ``q0:q1`` may see, as runs ``(a, b, full)``.

        ``full`` runs need no mask (every row may see every key of the run through causal,
        window, chunk and lengths, and there is no user mask); the others need
        :meth:`allowed`. Keys no row may see are left out, so a causal diagonal costs one
        narrow partial run instead of a partial block. Padding rows (``q_lengths``) are
        left out of ``q0:q1`` first. Arithmetic only: no arrays.
        """
        q1 = min(q1, self.rows(batch))
        k1 = min(k1, self.keys(batch))
        if q0 >= q1 or k0 >= k1:
            return []
        if not self._uniform(batch):  # several batch items at once: one conservative run
            return [(k0, k1, False)]
        v0, v1, f0, f1 = self._visible(q0, q1, k0, k1, batch)
        if v0 >= v1:
            return []
        if self.mask is not None or f0 >= f1:
            return [(v0, v1, False)]
        f0, f1 = max(f0, v0), min(f1, v1)
        runs = [(v0, f0, False), (f0, f1, True), (f1, v1, False)]
        return [r for r in runs if r[0] < r[1]]

    def query_range(self, k0: int, k1: int, batch: int | None = None) -> tuple[int, int]:
        """Rows ``[q0, q1)`` that may see any of the keys ``k0:k1`` of ``batch``; ``q0 >= q1``
        means none. The transpose of :meth:`segments`, for kernels that walk key blocks."""
        k1 = min(k1, self.keys(batch))
        rows = self.rows(batch)
        if k0 >= k1 or rows == 0:
            return 0, 0
        if not self._uniform(batch):
            return 0, rows
        lo, hi = self.band
        s = self.shift(batch)
        # j <= i + s + hi  <=>  i >= j - hi - s ;  j >= i + s - lo  <=>  i <= j + lo - s
        q0 = 0 if hi is None else max(0, k0 - hi - s)
        q1 = rows if lo is None else min(rows, k1 - 1 + lo - s + 1)
        if self.chunk is not None:  # rows whose chunk meets k0:k1
            c, ks = self.chunk, self.k_start
            q0 = max(q0, ((k0 + ks) // c) * c - ks - s)
            q1 = min(q1, ((k1 - 1 + ks) // c + 1) * c - ks - s)
        return max(q0, 0), q1

    # --- per-block arrays ----------------------------------------------------------
    def _per_batch(self, values: np.ndarray, index) -> np.ndarray:
        """``(B,)`` values as one number (``index`` given) or shaped ``(B, 1, ..., 1, 1, 1)``
        against ``lead + (rows, keys)``."""
        if not self.lead:
            return values[0]
        if index is not None:
            return values[index[0]]
        return values.reshape((-1,) + (1,) * (len(self.lead) - 1) + (1, 1))

    def _positions(self, q0, q1, k0, k1, index):
        """Aligned row positions ``i'`` (rows, 1) (or per batch item) and key positions ``j`` (1, keys)."""
        off = self.offset
        if isinstance(off, np.ndarray):
            off = self._per_batch(off, index)
        i = np.arange(q0, q1)[:, None] + self.q_start + off
        j = np.arange(k0, k1)[None, :] + self.k_start
        return i, j

    def allowed(self, q0: int = 0, q1: int | None = None, k0: int = 0, k1: int | None = None,
                index: tuple | None = None) -> np.ndarray | None:
        """Bool array (True = may attend) for rows q0:q1, keys k0:k1, or None if all True.

        With ``index=None`` the result broadcasts to ``lead + (q1-q0, k1-k0)``; with a tuple
        of ints selecting one leading position (``(b, h)`` for 4-D) it is ``(q1-q0, k1-k0)``.
        """
        q1 = self.tq if q1 is None else q1
        k1 = self.tk if k1 is None else k1
        i, j = self._positions(q0, q1, k0, k1, index)
        ok = None

        def both(extra):
            return extra if ok is None else ok & extra

        lo, hi = self.band
        if lo is not None:
            ok = both(j >= i - lo)
        if hi is not None:
            ok = both(j <= i + hi)
        if self.chunk is not None:
            ok = both(i // self.chunk == j // self.chunk)
        if self.kv_lengths is not None:
            ok = both(np.arange(k0, k1)[None, :] < self._per_batch(self.kv_lengths, index))
        if self.q_lengths is not None:
            ok = both(np.arange(q0, q1)[:, None] < self._per_batch(self.q_lengths, index))
        if self.mask is not None:
            ok = both(self._slice(self.mask, index, q0, q1, k0, k1))
        return ok

    def additive(self, q0: int = 0, q1: int | None = None, k0: int = 0, k1: int | None = None,
                 index: tuple | None = None, dtype=np.float64) -> np.ndarray | None:
        """Float array added to the scaled scores (bias + ALiBi) for the block, or None."""
        q1 = self.tq if q1 is None else q1
        k1 = self.tk if k1 is None else k1
        add = None
        if self.bias is not None:
            add = self._slice(self.bias, index, q0, q1, k0, k1).astype(dtype, copy=False)
        if self.alibi is not None:
            i, j = self._positions(q0, q1, k0, k1, index)
            dist = np.abs(i - j).astype(dtype)
            ali = -self.slopes(index, dtype) * dist
            add = ali if add is None else add + ali
        return add

    def slopes(self, index: tuple | None, dtype=np.float64):
        """ALiBi slopes of one leading position (a number), or all of them shaped to
        broadcast against ``lead + (rows, keys)``."""
        alibi = self.alibi.astype(dtype, copy=False)
        if index is not None:
            return alibi[index[-1]] if alibi.ndim == 1 else alibi[index[0], index[-1]]
        if alibi.ndim == 1:  # (Hq,) -> (Hq, 1, 1)
            return alibi.reshape((-1, 1, 1))
        # (B, Hq) -> (B, 1, ..., 1, Hq, 1, 1)
        return alibi.reshape((alibi.shape[0],) + (1,) * (len(self.lead) - 2) + (alibi.shape[1], 1, 1))

    def _slice(self, arr, index, q0, q1, k0, k1):
        """Rows q0:q1 and keys k0:k1 of a user array that broadcasts to lead + (Tq, Tk)."""
        rows = slice(q0, q1) if arr.shape[-2] != 1 else slice(0, 1)
        cols = slice(k0, k1) if arr.shape[-1] != 1 else slice(0, 1)
        if index is None:
            return arr[..., rows, cols]
        full = np.broadcast_to(arr, self.lead + arr.shape[-2:])
        return full[tuple(index) + (rows, cols)]


def _lengths(name: str, x, lead: tuple, size: int) -> np.ndarray:
    """``x`` as int64 ``(B,)`` lengths in ``[0, size]`` (B = the first leading axis)."""
    x = as_array(name, x)
    if x.dtype.kind not in "iu":
        raise ShapeError(f"{name} must be an integer array (B,); got dtype {x.dtype}")
    batch = lead[0] if lead else 1
    if x.ndim == 0:
        x = np.full(batch, int(x))
    if x.shape != (batch,):
        raise ShapeError(f"{name} must have shape (B,) = ({batch},) (B = the first leading axis); "
                         f"got {fmt_shape(x.shape)}")
    if x.size and (x.min() < 0 or x.max() > size):
        raise OptionError(f"{name} must lie in [0, {size}]; got values from {int(x.min())} to {int(x.max())}")
    return x.astype(np.int64)


def _dense(name: str, x, kind: str, target: tuple, names: str) -> np.ndarray:
    """A user mask or bias: an array of ``kind`` ("b" or "f") that broadcasts to ``target``."""
    if not isinstance(x, np.ndarray):
        x = as_array(name, x)
    if kind == "b" and x.dtype != np.bool_:
        raise ShapeError(f"mask must be a bool array (True = may attend); got dtype {x.dtype}. "
                         "For an additive float mask pass it as bias=")
    if kind == "f" and x.dtype.kind != "f":
        raise ShapeError(f"bias must be a real floating array; got dtype {x.dtype}")
    if x.ndim < 2:
        raise ShapeError(f"{name} must have at least 2 dimensions {names}; got shape {fmt_shape(x.shape)}")
    broadcasts_to(name, x.shape, target, names)
    return x


def _check_bias(bias: np.ndarray, dtype) -> None:
    if np.isnan(bias).any() or np.isposinf(bias).any():
        raise OptionError("bias must not contain NaN or +inf (-inf is allowed and means cannot attend)")
    top = np.finfo(dtype).max
    finite = np.abs(bias[np.isfinite(bias)])
    if bias.dtype.itemsize > np.dtype(dtype).itemsize and (finite > top).any():
        raise OptionError(
            f"bias must fit the compute dtype {np.dtype(dtype)} (|bias| <= {top:.4g}, or -inf "
            f"for cannot attend); got values up to {float(finite.max()):.4g}")


def _check_alibi(alibi, lead: tuple, reach: int, dtype) -> np.ndarray:
    alibi = as_array("alibi", alibi)
    if not lead:
        raise ShapeError("alibi needs a head axis: q must have shape (..., Hq, Tq, D); got (Tq, D)")
    shapes = [(lead[-1],)] + ([(lead[0], lead[-1])] if len(lead) >= 2 else [])
    if alibi.dtype.kind != "f" or alibi.shape not in shapes:
        expected = " or ".join(f"{n} = {fmt_shape(s)}" for n, s in zip(("(Hq,)", "(B, Hq)"), shapes))
        raise ShapeError(f"alibi must be float slopes of shape {expected}; got {fmt_shape(alibi.shape)} {alibi.dtype}")
    if not np.isfinite(alibi).all():
        raise OptionError("alibi slopes must be finite")
    # the largest term, slope·|i' - j|, must fit the compute dtype with room for log2(e) and
    # the kernels' sums (a slope of 1e39 is inf in float32, and inf·0 on the diagonal NaN)
    top = float(np.finfo(dtype).max) / 16
    largest = float(np.abs(alibi).max(initial=0.0)) * reach
    if largest > top:
        raise OptionError(
            f"alibi slopes times the largest distance |i' - j| <= {reach} must stay within "
            f"{top:.4g} in the compute dtype {np.dtype(dtype)}; got slopes up to "
            f"{float(np.abs(alibi).max()):.4g}")
    return alibi


def build_spec(lead: tuple, tq: int, tk: int, *, mask=None, bias=None, causal=False, align=None,
               window=None, chunk=None, kv_lengths=None, q_lengths=None, alibi=None, softcap=None,
               dropout_p=0.0, dropout_seed=None, dtype=np.float64) -> MaskSpec:
    """Check every mask option against the output's leading shape ``lead = (..., Hq)`` and
    the compute ``dtype`` (a bias must be representable in it)."""
    causal, align = parse_alignment(causal, align)
    left, right = parse_window(window)
    chunk = parse_chunk(chunk)
    softcap = parse_softcap(softcap)
    dropout_p, dropout_seed = parse_dropout(dropout_p, dropout_seed)
    if causal and right is not None and right > 0:
        raise OptionError(
            f"window={window!r} conflicts with causal=True: a causal query sees no key to its "
            f"right, so the window's right side must be 0 (use window=({left}, 0), or causal=False "
            f"with align='bottom_right' for a window that reaches right)")
    # Aligned positions lie in [-Tq, Tq + Tk): a window side of Tq + Tk or more limits nothing
    # and a chunk of more than Tq + Tk splits them as any larger one does, so both saturate
    # there and no position arithmetic meets a huge int (window=(None, sys.maxsize), chunk=10**30).
    reach = tq + tk
    left = None if left is not None and left >= reach else left
    right = None if right is not None and right >= reach else right
    chunk = None if chunk is None else min(chunk, reach + 1)
    target = lead + (tq, tk)
    names = "(..., Hq, Tq, Tk)" if len(lead) >= 1 else "(Tq, Tk)"
    if mask is not None:
        mask = _dense("mask", mask, "b", target, names)
    if bias is not None:
        bias = _dense("bias", bias, "f", target, names)
        _check_bias(bias, dtype)
    if kv_lengths is not None:
        kv_lengths = _lengths("kv_lengths", kv_lengths, lead, tk)
    if q_lengths is not None:
        q_lengths = _lengths("q_lengths", q_lengths, lead, tq)
    if alibi is not None:
        alibi = _check_alibi(alibi, lead, reach, dtype)
    offset = 0
    if align == "bottom_right":
        real_k = tk if kv_lengths is None else kv_lengths
        real_q = tq if q_lengths is None else q_lengths
        offset = real_k - real_q
        if isinstance(offset, np.ndarray) and np.ptp(offset) == 0:
            offset = int(offset[0]) if offset.size else 0
    return MaskSpec(lead=tuple(lead), tq=tq, tk=tk, causal=causal, left=left, right=right, chunk=chunk,
                    offset=offset, kv_lengths=kv_lengths, q_lengths=q_lengths, mask=mask, bias=bias,
                    alibi=alibi, softcap=softcap, dropout_p=dropout_p, dropout_seed=dropout_seed)
