"""Every way of saying "query i may (not) look at key j", parsed once into one :class:`MaskSpec`.

The options of :func:`qkv.attention` that restrict or bias the scores are:

- ``causal``: ``"top_left"`` (``True``) lets query i see keys ``j <= i``; ``"bottom_right"``
  lets it see ``j <= i + (Tk - Tq)``, so the last query sees the last key. Both are the same
  rule on an *aligned* query index ``i' = i + offset`` with offset 0 or ``Tk - Tq``.
- ``window=(left, right)``: ``i' - left <= j <= i' + right`` (``None`` on a side: unbounded).
- ``kv_lengths`` ``(B,)``: keys ``j >= kv_lengths[b]`` do not exist for batch item b.
- ``mask``: a bool array, True = may attend, broadcast to ``(..., Hq, Tq, Tk)``.
- ``bias``: a float array added to the scaled scores, same broadcasting.
- ``alibi``: slopes ``(Hq,)``; head h adds ``-slope[h] * |i' - j|``.

A kernel asks the spec about one block of rows ``q0:q1`` and columns ``k0:k1`` at a time:
:meth:`MaskSpec.segments` says which keys of the block the structured part (causal,
window, lengths) leaves visible, as runs that need no mask and runs that do;
:meth:`MaskSpec.query_range` which rows see any key of a key block (for a backward that
walks key blocks); :meth:`MaskSpec.allowed` gives a block's boolean mask and
:meth:`MaskSpec.additive` its additive bias. No method makes a ``(Tq, Tk)`` array unless
asked for the whole range.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ShapeError, as_array, broadcasts_to, fmt_shape

def parse_causal(causal):
    """``False``/``None`` -> None; ``True``/``"top_left"`` -> "top_left"; ``"bottom_right"``.

    Only these: ``1``, ``0`` or ``1.0`` are refused rather than read as booleans.
    """
    if causal is None or isinstance(causal, (bool, np.bool_)):
        return "top_left" if causal else None
    if isinstance(causal, str) and causal in ("top_left", "bottom_right"):
        return causal
    raise ShapeError(f"causal must be False, True, 'top_left' or 'bottom_right'; got {causal!r}")


def parse_window(window):
    """``None`` -> (None, None); ``n`` -> (n, 0); ``(left, right)`` with ints >= 0 or None."""
    if window is None:
        return None, None
    if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
        window = (int(window), 0)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ShapeError(
            f"window must be an int n (meaning (n, 0)) or a pair (left, right) of ints >= 0 "
            f"or None; got {window!r}"
        )
    sides = []
    for side, w in zip(("left", "right"), window):
        if w is None:
            sides.append(None)
        elif isinstance(w, (int, np.integer)) and not isinstance(w, bool) and w >= 0:
            sides.append(int(w))
        else:
            raise ShapeError(f"window {side} must be an int >= 0 or None; got {w!r} in window={window!r}")
    return tuple(sides)


@dataclass(frozen=True)
class MaskSpec:
    """Which keys each query may attend to, and what is added to its scores.

    ``lead`` is the output's leading shape ``(..., Hq)``; arrays given by the user are kept
    as given (already checked to broadcast to ``lead + (Tq, Tk)``).
    """

    lead: tuple
    tq: int
    tk: int
    causal: str | None = None
    left: int | None = None
    right: int | None = None
    kv_lengths: np.ndarray | None = None
    mask: np.ndarray | None = None
    bias: np.ndarray | None = None
    alibi: np.ndarray | None = None

    # --- structure -----------------------------------------------------------------
    @property
    def offset(self) -> int:
        """Aligned query index is ``i' = i + offset``."""
        return self.tk - self.tq if self.causal == "bottom_right" else 0

    @property
    def band(self) -> tuple:
        """``(lo, hi)`` such that query i' may see ``i' - lo <= j <= i' + hi`` (None: no limit)."""
        hi = self.right
        if self.causal is not None:
            hi = 0 if hi is None else min(hi, 0)
        return self.left, hi

    @property
    def is_trivial(self) -> bool:
        """True when every query may see every key with no bias."""
        lo, hi = self.band
        return (lo is None and hi is None and self.kv_lengths is None and self.mask is None
                and self.bias is None and self.alibi is None)

    def _lengths(self, batch: int | None) -> np.ndarray | None:
        """The kv_lengths that apply: one ``batch`` item's (as a 1-array), every item's for
        ``None``, or None without lengths."""
        if self.kv_lengths is None:
            return None
        return self.kv_lengths if batch is None else self.kv_lengths[batch:batch + 1]

    def query_range(self, k0: int, k1: int, batch: int | None = None) -> tuple[int, int]:
        """Rows ``[q0, q1)`` that may see any of the keys ``k0:k1`` through causal, window
        and (for one ``batch`` item, or any) kv_lengths; ``q0 >= q1`` means none. For
        kernels that walk key blocks."""
        lo, hi = self.band
        off = self.offset
        lengths = self._lengths(batch)
        if lengths is not None:
            k1 = min(k1, int(lengths.max(initial=0)))
        if k0 >= k1:
            return 0, 0
        # j <= i' + hi  <=>  i >= j - hi - off ;  j >= i' - lo  <=>  i <= j + lo - off
        q0 = 0 if hi is None else max(0, k0 - hi - off)
        q1 = self.tq if lo is None else min(self.tq, k1 - 1 + lo - off + 1)
        return q0, q1

    def segments(self, q0: int, q1: int, k0: int, k1: int, batch: int | None = None) -> list:
        """The keys of ``k0:k1`` that rows ``q0:q1`` may see, as runs ``(a, b, full)``.

        ``full`` runs need no mask (every row may see every key of the run through causal,
        window and lengths, and there is no user mask); the others need
        :meth:`allowed`. Keys no row may see are left out, so a causal diagonal costs one
        narrow partial run instead of a partial block. Arithmetic only: no arrays.
        """
        lo, hi = self.band
        off = self.offset
        lengths = self._lengths(batch)
        ragged = False  # lengths that differ inside k0:k1: no run is the same for every item
        if lengths is not None:
            k1 = min(k1, int(lengths.max(initial=0)))
            ragged = int(lengths.min(initial=self.tk)) < k1
        # keys some row sees, then keys every row sees
        v0 = k0 if lo is None else max(k0, q0 + off - lo)
        v1 = k1 if hi is None else min(k1, q1 - 1 + off + hi + 1)
        if v0 >= v1 or q0 >= q1:
            return []
        if self.mask is not None or ragged:
            return [(v0, v1, False)]
        f0 = v0 if lo is None else max(v0, q1 - 1 + off - lo)
        f1 = v1 if hi is None else min(v1, q0 + off + hi + 1)
        if f0 >= f1:
            return [(v0, v1, False)]
        runs = [(v0, f0, False), (f0, f1, True), (f1, v1, False)]
        return [r for r in runs if r[0] < r[1]]

    # --- per-block arrays ----------------------------------------------------------
    def allowed(self, q0: int = 0, q1: int | None = None, k0: int = 0, k1: int | None = None,
                index: tuple | None = None) -> np.ndarray | None:
        """Bool array (True = may attend) for rows q0:q1, keys k0:k1, or None if all True.

        With ``index=None`` the result broadcasts to ``lead + (q1-q0, k1-k0)``; with a tuple
        of ints selecting one leading position (``(b, h)`` for 4-D) it is ``(q1-q0, k1-k0)``.
        """
        q1 = self.tq if q1 is None else q1
        k1 = self.tk if k1 is None else k1
        i = np.arange(q0, q1)[:, None] + self.offset  # aligned query index i'
        j = np.arange(k0, k1)[None, :]
        ok = None
        lo, hi = self.band
        if lo is not None:
            ok = j >= i - lo
        if hi is not None:
            ok = (j <= i + hi) if ok is None else ok & (j <= i + hi)
        if self.kv_lengths is not None:
            if not self.lead:
                lens = self.kv_lengths[0]
            elif index is None:  # (B,) -> (B, 1, ..., 1, 1, 1) against lead + (rows, keys)
                lens = self.kv_lengths.reshape((-1,) + (1,) * (len(self.lead) - 1) + (1, 1))
            else:
                lens = self.kv_lengths[index[0]]
            inside = j < lens
            ok = inside if ok is None else ok & inside
        if self.mask is not None:
            m = self._slice(self.mask, index, q0, q1, k0, k1)
            ok = m if ok is None else ok & m
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
            i = np.arange(q0, q1)[:, None] + self.offset
            j = np.arange(k0, k1)[None, :]
            dist = np.abs(i - j).astype(dtype)
            if index is None:  # (Hq,) -> (Hq, 1, 1) against lead + (rows, keys)
                slopes = self.alibi.astype(dtype).reshape((-1, 1, 1))
            else:
                slopes = np.asarray(self.alibi[index[-1]], dtype=dtype)
            ali = -slopes * dist
            add = ali if add is None else add + ali
        return add

    def _slice(self, arr, index, q0, q1, k0, k1):
        """Rows q0:q1 and keys k0:k1 of a user array that broadcasts to lead + (Tq, Tk)."""
        rows = slice(q0, q1) if arr.shape[-2] != 1 else slice(0, 1)
        cols = slice(k0, k1) if arr.shape[-1] != 1 else slice(0, 1)
        if index is None:
            return arr[..., rows, cols]
        full = np.broadcast_to(arr, self.lead + arr.shape[-2:])
        return full[tuple(index) + (rows, cols)]


def build_spec(lead: tuple, tq: int, tk: int, *, mask=None, bias=None, causal=False,
               window=None, kv_lengths=None, alibi=None, dtype=np.float64) -> MaskSpec:
    """Check every mask option against the output's leading shape ``lead = (..., Hq)`` and
    the compute ``dtype`` (a bias must be representable in it)."""
    causal = parse_causal(causal)
    left, right = parse_window(window)
    if causal is not None and right is not None and right > 0:
        raise ShapeError(
            f"window={window!r} conflicts with causal={causal!r}: a causal query sees no key to its "
            f"right, so the window's right side must be 0 (use window=({left}, 0))"
        )
    target = lead + (tq, tk)
    names = "(..., Hq, Tq, Tk)" if len(lead) >= 1 else "(Tq, Tk)"

    if mask is not None:
        if not isinstance(mask, np.ndarray):
            mask = as_array("mask", mask)
        if mask.dtype != np.bool_:
            raise ShapeError(
                f"mask must be a bool array (True = may attend); got dtype {mask.dtype}. "
                "For an additive float mask pass it as bias="
            )
        if mask.ndim < 2:
            raise ShapeError(f"mask must have at least 2 dimensions {names}; got shape {fmt_shape(mask.shape)}")
        broadcasts_to("mask", mask.shape, target, names)

    if bias is not None:
        if not isinstance(bias, np.ndarray):
            bias = as_array("bias", bias)
        if bias.dtype.kind != "f":
            raise ShapeError(f"bias must be a real floating array; got dtype {bias.dtype}")
        if bias.ndim < 2:
            raise ShapeError(f"bias must have at least 2 dimensions {names}; got shape {fmt_shape(bias.shape)}")
        broadcasts_to("bias", bias.shape, target, names)
        if np.isnan(bias).any() or np.isposinf(bias).any():
            raise ShapeError("bias must not contain NaN or +inf (-inf is allowed and means cannot attend)")
        top = np.finfo(dtype).max
        if bias.dtype.itemsize > np.dtype(dtype).itemsize and (np.abs(bias[np.isfinite(bias)]) > top).any():
            raise ShapeError(
                f"bias must fit the compute dtype {np.dtype(dtype)} (|bias| <= {top:.4g}, or -inf "
                f"for cannot attend); got values up to {float(np.abs(bias[np.isfinite(bias)]).max()):.4g}"
            )

    if kv_lengths is not None:
        kv_lengths = as_array("kv_lengths", kv_lengths)
        if kv_lengths.dtype.kind not in "iu":
            raise ShapeError(f"kv_lengths must be an integer array (B,); got dtype {kv_lengths.dtype}")
        batch = lead[0] if lead else 1
        if kv_lengths.ndim == 0:
            kv_lengths = np.full(batch, int(kv_lengths))
        if kv_lengths.shape != (batch,):
            raise ShapeError(
                f"kv_lengths must have shape (B,) = ({batch},) (B = the first leading axis); "
                f"got {fmt_shape(kv_lengths.shape)}"
            )
        if kv_lengths.size and (kv_lengths.min() < 0 or kv_lengths.max() > tk):
            raise ShapeError(
                f"kv_lengths must lie in [0, Tk] = [0, {tk}]; got values from "
                f"{int(kv_lengths.min())} to {int(kv_lengths.max())}"
            )
        kv_lengths = kv_lengths.astype(np.int64)

    if alibi is not None:
        alibi = as_array("alibi", alibi)
        if not lead:
            raise ShapeError("alibi needs a head axis: q must have shape (..., Hq, Tq, D); got (Tq, D)")
        if alibi.dtype.kind != "f" or alibi.shape != (lead[-1],):
            raise ShapeError(
                f"alibi must be float slopes of shape (Hq,) = ({lead[-1]},); "
                f"got {fmt_shape(alibi.shape)} {alibi.dtype}"
            )
        if not np.isfinite(alibi).all():
            raise ShapeError("alibi slopes must be finite")

    return MaskSpec(lead=tuple(lead), tq=tq, tk=tk, causal=causal, left=left, right=right,
                    kv_lengths=kv_lengths, mask=mask, bias=bias, alibi=alibi)
