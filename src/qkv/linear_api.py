"""The public ``linear_attention`` and ``linear_attention_backward``: the checks of
:func:`qkv.attention`, then the kernel :mod:`qkv.kernels.linear`."""
from __future__ import annotations

from .api import prepare, sum_to
from . import options as opts
from .errors import ShapeError, as_float_array, fmt_shape, reject_options
from .kernels import linear


def _problem(q, k, v, causal, gqa):
    """Checked, broadcast arrays in the compute dtype (exactly as :func:`qkv.attention` checks them)."""
    return prepare(q, k, v, causal=causal, gqa=gqa)


def _options(prob) -> dict:
    return dict(causal=bool(prob.spec.causal), offset=int(prob.spec.offset), group=prob.group)


def linear_attention(q, k, v, *, causal=False, gqa=False, **unknown):
    """Linear attention (Katharopoulos et al., 2020) with the feature map ``φ(x) = elu(x) + 1``.

    Query row ``i`` averages the value rows with positive weights ``φ(q_i)·φ(k_j)``::

        out_i = Σ_j (φ(q_i)·φ(k_j)) v_j / Σ_j φ(q_i)·φ(k_j)        over j <= i' when causal

    There is no ``1/√D`` and no softmax: the sums factor as ``φ(q_i) (Σ_j φ(k_j)ᵀ v_j)``,
    so the cost is O(T·D·Dv) and the memory O(T·D), never a ``(Tq, Tk)`` array. Causal
    runs in chunks of 64 rows with a running state over the earlier chunks, accumulated
    with compensated sums so float32 stays accurate at long T.

    Layouts, broadcasting, ``gqa`` and the ``causal`` alignments (``True``/``"top_left"``:
    ``i' = i``; ``"bottom_right"``: ``i' = i + Tk - Tq``) are those of :func:`qkv.attention`,
    and so are the checks and errors. A query that sees no key gets output 0. float16 and
    float32 compute in float32, float64 in float64; the output has q's dtype.

    Args:
        q: ``(..., Tq, D)``. k: ``(..., Tk, D)``. v: ``(..., Tk, Dv)``; same dtype.
        causal: ``False``, ``True``, ``"top_left"`` or ``"bottom_right"``.
        gqa: query heads ``h*G .. h*G+G-1`` share kv head h (``Hq % Hkv == 0``).

    Returns:
        ``out (..., Hq, Tq, Dv)`` in q's dtype.

    >>> import numpy as np, qkv
    >>> x = np.array([[1., 0.], [0., 1.], [1., 1.]])
    >>> qkv.linear_attention(x, x, x).round(3)
    array([[0.733, 0.667],
           [0.667, 0.733],
           [0.7  , 0.7  ]])
    """
    try:
        reject_options(linear_attention, unknown, opts.LACKS["linear_attention"])
        prob = _problem(q, k, v, causal, gqa)
    except ShapeError as err:
        raise type(err)(str(err)) from None  # the caller's line, not our internals
    out, _ = linear.forward(prob.q, prob.k, prob.v, **_options(prob))
    return out.astype(prob.in_dtype, copy=False)


def linear_attention_backward(dout, q, k, v, *, causal=False, gqa=False, **unknown):
    """Gradients ``(dq, dk, dv)`` of :func:`linear_attention` given ``dout = ∂L/∂out``.

    Recomputes the forward's sums (nothing needs saving), then three products of the
    same chunked kind, two of them running backwards in time when causal. Each gradient
    has its input's shape and dtype; broadcast axes and the query heads sharing a kv head
    under ``gqa`` are summed. Rows that saw no key get gradient 0.

    Args:
        dout: ``(..., Hq, Tq, Dv)``, the shape of the output.
        q, k, v, causal, gqa: exactly as passed to :func:`linear_attention`.

    Returns:
        ``(dq, dk, dv)`` with the shapes and dtypes of ``(q, k, v)``.
    """
    try:
        reject_options(linear_attention_backward, unknown, opts.LACKS["linear_attention"])
        prob = _problem(q, k, v, causal, gqa)
        out_shape = prob.spec.lead + (prob.spec.tq, prob.v.shape[-1])
        dout = as_float_array("dout", dout)
        if dout.shape != out_shape:
            raise ShapeError(f"dout must have the output's shape (..., Hq, Tq, Dv) = {fmt_shape(out_shape)}; "
                             f"got {fmt_shape(dout.shape)}")
    except ShapeError as err:
        raise type(err)(str(err)) from None
    dq, dk, dv = linear.backward(dout.astype(prob.q.dtype, copy=False), prob.q, prob.k, prob.v, **_options(prob))
    q_shape, k_shape, v_shape = prob.shapes
    return (sum_to(dq, q_shape).astype(prob.in_dtype, copy=False),
            sum_to(dk, k_shape).astype(prob.in_dtype, copy=False),
            sum_to(dv, v_shape).astype(prob.in_dtype, copy=False))
