"""The public ``attention`` and ``attention_backward``: every check, then dispatch to a kernel.

Both are one :class:`Prepared` call: :func:`prepare_call` checks q, k, v and the options once
(:func:`qkv.problem.prepare`) and chooses the kernel (:func:`choose_kernel`); its ``forward``
and ``backward`` run it. A caller that runs the forward and the backward of one problem (the
layers of :mod:`qkv.nn`) keeps the prepared call between them instead of checking twice.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import kernels
from .kernels import bias_grad, stacked
from .kernels.rows import kernel as rows, numpy_rows as rows_numpy
from .kernels.registry import Kernel
from . import options as opts
from .errors import ShapeError, as_float_array, fmt_shape
from .problem import Problem, prepare, sum_to  # noqa: F401  (qkv.api.prepare, sum_to: the ring's too)

METHODS = ("auto",) + kernels.names()   # at import; kernels.names() is the registry now


# method="auto" takes the tiled kernel from this many score entries of all heads together
# (B·H·Tq·Tk); below, the dense path's fewer Python steps win. Measured (2 cores, float32, D =
# 16 and 64, 1 and 8 heads, medians of 40): dense/flash 0.8-1.1 at 2^17, 1.0-1.6 at 2^18.
AUTO_FLASH_MIN = 2 ** 18
STACKED = Kernel("stacked", stacked, makes_weights=False, dense=False,  # not a method= name: auto's choice
                 summary="dense, exact, many heads a work unit")
ROWS = Kernel("rows", rows, makes_weights=False, dense=False,  # auto's choice with the fast extra
              summary="dense products, one compiled softmax pass a row, many heads a work unit")
ROWS_NUMPY = Kernel("rows-numpy", rows_numpy, makes_weights=False, dense=False,  # auto's, without it
                    summary="the row kernel's products and blocks, the fewest NumPy passes between them")


class _WeightsBeside:
    """A kernel without weights for out/lse (and the backward), the dense path for the weights."""

    def __init__(self, kern):
        self.kern = kern
        self.backward = kern.backward

    def forward(self, q, k, v, spec, scale, group=1, return_weights=False):
        out, lse, _ = self.kern.forward(q, k, v, spec, scale, group)
        weights = None
        if return_weights:
            weights = kernels.lookup("reference").forward(q, k, v, spec, scale, group, return_weights=True)[2]
        return out, lse, weights


# From AUTO_FLASH_MIN entries on, auto takes the stacked dense kernel (qkv.kernels.stacked:
# the reference's bits) over the tiled one up to AUTO_STACK_MAX entries a head (T <= 256).
# Measured (Zen 4 AVX-512, 2 cores, float32, medians of 5), stacked / tiled time: 0.25-0.29 at
# (32, 8, 128, 64), 0.48-0.77 at (64, 6, 256, 64) and (16, 12, 192, 64), 0.42-1.1 at (1, 8,
# 256, 16); at T = 512 0.76-1.17 (left to the tiles). Below AUTO_FLASH_MIN the dense path
# over all heads at once is as fast or faster ((12, 4, 64, 32) fwd+bwd 2.3 against 2.8 ms).
AUTO_STACK_MAX = 256 * 256
# With the fast extra, float32, method="auto" takes qkv.kernels.rows.kernel (the stacked products with
# one compiled softmax pass a row, causal rows in blocks that skip the keys they cannot see)
# at any size up to this many entries a head, before all of the above. Measured (Zen 4) in
# CPU time on one thread, fwd+bwd, torch SDPA / rows, AVX-512: 1.04-1.18 full and 1.10-1.53
# causal from (12, 4, 64, 32) to (4, 16, 512, 128), 1.00 / 1.25 at (8, 12, 1024, 64), where
# the tiled kernel is 0.90 / 1.01; at T = 4096 the rows lose to the tiles in the backward
# (2.0 against 1.5 s). Two threads, the shapes suite: docs/speed.md.
AUTO_ROWS_MAX = 1024 * 1024
# Without the fast extra, float32 plain scores: qkv.kernels.rows.numpy_rows from this many entries
# (B·H·Tq·Tk) on. Measured (Zen 4, fwd+bwd causal): 103 µs against the reference's 81 at
# (1, 1, 8, 8), 279 against 286 at (4, 4, 32, 32); the shapes suite: docs/speed.md.
AUTO_ROWS_NUMPY_MIN = 2 ** 14
# Few queries against more keys than the row kernels take (decoding from a long KV cache: Tq = 1,
# Tk > rows.MAX_KEYS) go to the tiled kernel once the dense path's bytes, every query head's
# keys and values and 8 float32 passes over its scores, lead·Tk·(D + Dv + 8·Tq)·itemsize, reach
# AUTO_LONG_KEYS_BYTES: below, K and V stay in cache and the dense path's fewer Python steps win.
# Measured (Zen 4, 1 thread, float32, causal bottom-right, loaded machine), ms dense / tiled:
# Tq = 1, (H, Tk, D) = (4, 16384, 32) 0.86 / 1.8 (19 MB), (8, 4096, 64) 1.08 / 1.77 (18 MB);
# (4, 16384, 64) 3.2 / 2.8 (36 MB), (8, 16384, 128) 16.8 / 11.5, (8, 65536, 128) 65 / 47,
# (4, 65536, 32) 7.5 / 6.7; Tq = 4, (8, 4096, 64) 3.2 / 2.4 (21 MB), (4, 16384, 64) 12.1 / 4.4,
# (8, 65536, 128) 140 / 65; one head, (1, 65536, 64) 3.2 / 7.0 is the exception (36 MB, tiled).
# Before, these went to the stacked kernel (Tq·Tk <= AUTO_STACK_MAX, measured for square T <= 256),
# which was as slow as the reference at these shapes.
AUTO_LONG_KEYS_BYTES = 20 * 2 ** 20


def choose_kernel(method: str, prob: Problem, need_weights: bool = False):
    """The registered kernel (:mod:`qkv.kernels.registry`) that runs this problem (for
    ``method="auto"`` possibly the stacked dense kernel, which gives the reference's bits, or
    a row kernel); with ``need_weights`` one whose forward returns the weights too."""
    spec = prob.spec
    entries = math.prod(spec.lead) * spec.tq * spec.tk
    if method == "auto":
        if not need_weights and spec.tq * spec.tk <= AUTO_ROWS_MAX:
            if rows.applies(spec, prob.q.dtype):
                return ROWS
            if entries >= AUTO_ROWS_NUMPY_MIN and rows_numpy.applies(spec, prob.q.dtype):
                return ROWS_NUMPY
        if spec.tk > rows.MAX_KEYS and _dense_bytes(prob) >= AUTO_LONG_KEYS_BYTES:
            method = "flash"  # few queries, many keys: see AUTO_LONG_KEYS_BYTES
        elif (not need_weights and spec.tq * spec.tk <= AUTO_STACK_MAX and entries >= AUTO_FLASH_MIN
                and stacked.applies(spec)):
            return STACKED
        else:
            method = "flash" if entries >= AUTO_FLASH_MIN else "reference"
    kern = kernels.lookup(method)
    if kern.dense or need_weights:
        _dense_fits(entries, prob.q.dtype, f"method={method!r}" if kern.dense else "return_weights=True")
    return _WeightsBeside(kern) if need_weights and not kern.makes_weights else kern


def _dense_bytes(prob: Problem) -> int:
    """What the dense path moves: every query head's K and V and 8 passes over its scores,
    ``lead·Tk·(D + Dv + 8·Tq)·itemsize`` (see :data:`AUTO_LONG_KEYS_BYTES`)."""
    spec = prob.spec
    per_key = prob.q.shape[-1] + prob.v.shape[-1] + 8 * spec.tq
    return math.prod(spec.lead) * spec.tk * per_key * prob.q.dtype.itemsize


def _available_bytes() -> int | None:
    """Memory the system can still hand out (:func:`qkv.heap.available_memory`), or None where unknown."""
    from .heap import available_memory

    return available_memory()


DENSE_CHECK_MIN = 64 * 2 ** 20  # bytes of dense arrays below which no machine is asked what it has free


def _dense_fits(entries: int, dtype, why: str) -> None:
    """A MemoryError before any work when the dense ``(..., Tq, Tk)`` arrays (scores,
    exponentials, weights: three of them) cannot fit, instead of one after a long forward."""
    need = 3 * entries * np.dtype(dtype).itemsize
    if need < DENSE_CHECK_MIN:  # reading /proc/meminfo costs more than a tiny call's arithmetic
        return
    free = _available_bytes()
    if free is not None and need > free:
        raise MemoryError(
            f"{why} makes dense (..., Hq, Tq, Tk) arrays of {entries:,} entries: about "
            f"{need / 2**30:.1f} GiB in {np.dtype(dtype)}, and this machine has "
            f"{free / 2**30:.1f} GiB available. Leave return_weights off and use method='flash' "
            f"(O(T·D) memory), or look at fewer rows at a time")


FORWARD = opts.names("mask", "problem", "output", "kernel")   # qkv.attention's options, in order
BACKWARD = opts.names("mask", "problem", "kernel")            # qkv.attention_backward's


@dataclass(frozen=True)
class Prepared:
    """A checked attention call: the :class:`~qkv.problem.Problem` and the kernel chosen for it.

    ``forward`` and ``backward`` are :func:`attention` and :func:`attention_backward` without
    the checks of q, k, v and the options, which :func:`prepare_call` made once. The layers of
    :mod:`qkv.nn` keep one from a forward to its backward (in nanoGPT's training step the
    checks were 90 µs of 1.5 ms an attention backward).
    """

    problem: Problem
    kernel: object   # the kernel interface of qkv.kernels.registry.Kernel

    def forward(self, return_lse: bool = False, return_weights: bool = False):
        """``out``, then ``lse`` and ``weights`` as asked, as :func:`attention` returns them."""
        prob = self.problem
        out, lse, weights = self.kernel.forward(prob.q, prob.k, prob.v, prob.spec, prob.scale, prob.group,
                                                return_weights=return_weights)
        result = [out.astype(prob.in_dtype, copy=False)]
        if return_lse:
            result.append(lse)
        if return_weights:
            result.append(weights.astype(prob.in_dtype, copy=False))
        return result[0] if len(result) == 1 else tuple(result)

    def backward(self, dout, out, lse, dlse=None, return_dbias: bool = False):
        """``(dq, dk, dv)`` (and ``dbias``), as :func:`attention_backward` returns them; ``dout``,
        ``out``, ``lse`` and ``dlse`` are checked against the problem's shapes."""
        prob = self.problem
        try:
            opts.parse_flag("return_dbias", return_dbias)
            if return_dbias and prob.spec.bias is None:
                raise ShapeError("return_dbias=True needs the bias= the forward was given; got no bias")
            saved = self._saved(dout, out, lse, dlse)
        except ShapeError as err:
            raise type(err)(str(err)) from None
        extra = {} if saved["dlse"] is None else {"dlse": saved["dlse"]}
        args = (saved["dout"], prob.q, prob.k, prob.v, saved["out"], saved["lse"], prob.spec, prob.scale, prob.group)
        dq, dk, dv = self.kernel.backward(*args, **extra)
        q_shape, k_shape, v_shape = prob.shapes
        grads = (sum_to(dq, q_shape).astype(prob.in_dtype, copy=False),
                 sum_to(dk, k_shape).astype(prob.in_dtype, copy=False),
                 sum_to(dv, v_shape).astype(prob.in_dtype, copy=False))
        if not return_dbias:
            return grads
        return grads + (bias_grad.backward(*args, **extra).astype(prob.spec.bias.dtype, copy=False),)

    def _saved(self, dout, out, lse, dlse) -> dict:
        """``dout``, ``out``, ``lse`` (and ``dlse``) checked against the problem, in the compute dtype."""
        prob = self.problem
        out_shape = prob.spec.lead + (prob.spec.tq, prob.v.shape[-1])
        names = "(..., Hq, Tq, Dv)"
        arrays = {"dlse": None}
        for name, x, shape, nm in (("dout", dout, out_shape, names), ("out", out, out_shape, names),
                                   ("lse", lse, out_shape[:-1], "(..., Hq, Tq)"),
                                   ("dlse", dlse, out_shape[:-1], "(..., Hq, Tq)")):
            if x is None and name == "dlse":
                continue
            x = as_float_array(name, x)
            if x.shape != shape:
                raise ShapeError(f"{name} must have shape {nm} = {fmt_shape(shape)}; got {fmt_shape(x.shape)}")
            arrays[name] = x.astype(prob.q.dtype, copy=False)
        return arrays


def prepare_call(q, k, v, *, method="auto", return_weights=False, **options) -> Prepared:
    """The :class:`Prepared` call of :func:`attention` with these arrays and options (those of
    the problem, ``method``, and ``return_weights``, which may choose another kernel): every
    check made, nothing computed.

    >>> import numpy as np, qkv.api
    >>> x = np.eye(3)
    >>> call = qkv.api.prepare_call(x, x, x, causal=True)
    >>> out, lse = call.forward(return_lse=True)
    >>> dout = np.ones_like(out)
    >>> grads = call.backward(dout, out, lse)            # (dq, dk, dv), as qkv.attention_backward's
    >>> all(np.array_equal(a, b) for a, b in zip(grads, qkv.attention_backward(dout, x, x, x, out, lse, causal=True)))
    True
    """
    try:
        return _prepared(q, k, v, method, return_weights, opts.bind("prepare_call", options, opts.PROBLEM))
    except ShapeError as err:
        raise type(err)(str(err)) from None  # the caller's line, not our internals


def _prepared(q, k, v, method, return_weights, bound: dict) -> Prepared:
    """:func:`prepare_call` of options already bound (``bound`` holds every problem option and
    may hold others: binding them again cost a small call 3 µs of its 100)."""
    opts.parse_flag("return_weights", return_weights)
    prob = prepare(q, k, v, **{name: bound[name] for name in opts.PROBLEM})
    return Prepared(prob, choose_kernel(method, prob, return_weights))


def attention(q, k, v, **options):
    """Scaled dot-product attention ``softmax(scale · q kᵀ + bias) v`` with masks, soft-capping and dropout.

    Each query row ``i`` takes a weighted average of the value rows; the weights are a
    softmax over the keys it may attend to. Layout ``(..., T, D)``: with 4-D arrays
    ``q (B, Hq, Tq, D)``, ``k (B, Hkv, Tk, D)``, ``v (B, Hkv, Tk, Dv)``; a 2-D ``(T, D)``
    input is a single sequence. Leading axes broadcast as in ``np.matmul``.

    **Alignment** (``align``) places the queries against the keys when ``Tq != Tk``; it
    governs causal, window, chunk and ALiBi alike. Query i is at position ``i' = i``
    (``"top_left"``, the default, PyTorch's ``is_causal``) or ``i' = i + Tk - Tq``
    (``"bottom_right"``, flash-attn's and the KV-cache convention: the last query is the
    newest token). With ``kv_lengths``/``q_lengths`` the real lengths of each batch item are
    used: ``i' = i + kv_lengths[b] - q_lengths[b]``. For ``Tq = 2, Tk = 5`` (1 = may attend)::

        causal=True                    causal=True, align="bottom_right"
        (query i sees j <= i)          (query i sees j <= i + Tk - Tq)
            1 0 0 0 0                      1 1 1 1 0
            1 1 0 0 0                      1 1 1 1 1

        causal=True, align="bottom_right", kv_lengths=[3] (a cache of 5 holding 3 keys)
            1 1 0 0 0
            1 1 1 0 0

    ``causal="top_left"``/``"bottom_right"`` are shorthands for ``causal=True`` with that align.

    **Window** ``(left, right)``: query i sees keys ``i' - left <= j <= i' + right``;
    ``window=n`` is ``(n, 0)``; ``None`` on a side is unbounded. Causal and window combine
    (both must allow); with causal the window's right side must be 0.

    **Chunk** ``C``: query i sees key j only if ``⌊i'/C⌋ = ⌊j/C⌋`` (with causal: Llama 4's
    chunked attention). For ``Tq = Tk = 6``, ``chunk=3``, ``causal=True``::

        1 0 0 0 0 0
        1 1 0 0 0 0
        1 1 1 0 0 0
        0 0 0 1 0 0
        0 0 0 1 1 0
        0 0 0 1 1 1

    **Heads**: with ``gqa=True``, ``Hq`` must be a multiple of ``Hkv`` and query heads
    ``h*G .. h*G+G-1`` (``G = Hq // Hkv``) share kv head ``h``; MQA is ``Hkv = 1``.

    **A row that may attend to nothing** (masked out entirely, ``kv_lengths = 0``, or a
    padding row at or past ``q_lengths[b]``) gets output 0, lse ``-inf``, weights 0 and gradient 0: never NaN, never a warning.

    Args:
        q: ``(..., Tq, D)`` float16/32/64. k: ``(..., Tk, D)``. v: ``(..., Tk, Dv)``; same dtype.
        mask: bool, True = may attend; broadcasts to ``(..., Hq, Tq, Tk)``.
        bias: float, added to the scaled scores; broadcasts to ``(..., Hq, Tq, Tk)``;
            ``-inf`` entries mean "may not attend".
        causal: ``False`` or ``True`` (or an alignment name, the shorthand).
        align: ``"top_left"`` (default) or ``"bottom_right"``.
        window: ``None``, ``n`` or ``(left, right)``.
        chunk: ``None`` or keys per chunk ``C``.
        kv_lengths: int ``(B,)`` (B = first leading axis); keys ``j >= kv_lengths[b]`` are
            never read, so whatever they hold (even NaN) cannot reach the result.
        q_lengths: int ``(B,)``; query rows ``i >= q_lengths[b]`` are padding: never read,
            output 0, lse ``-inf``, gradient 0.
        alibi: float slopes ``(Hq,)`` or ``(B, Hq)``: head h adds ``-slope * |i' - j|``.
        softcap: ``c > 0`` (None or 0: off): the scaled product ``x = scale · q kᵀ`` becomes
            ``c · tanh(x / c)`` before bias, ALiBi and the masks (Gemma 2, flash-attn).
        dropout_p: ``0 <= p < 1``: after the softmax the weights become ``P ∘ keep / (1 - p)``
            (inverted dropout, as SDPA's); lse stays the undropped one.
        dropout_seed: int, needed when ``dropout_p > 0``: ``keep`` is a function of (seed,
            batch, head, row, column) (:mod:`qkv.score_ops`), so the backward, every kernel
            and every thread count draw the same mask from it.
        scale: multiplies ``q kᵀ``; default ``1/sqrt(D)``.
        gqa: grouped-query heads, see above.
        return_lse: also return ``lse (..., Hq, Tq)``, ``log Σ_j exp(s_ij)`` over allowed keys.
        return_weights: also return the weights ``(..., Hq, Tq, Tk)`` (after dropout).
        method: ``"reference"`` (dense, exact), ``"flash"`` (tiled), ``"auto"``.

    Returns:
        ``out (..., Hq, Tq, Dv)`` in q's dtype, then ``lse`` (float32, or float64 for
        float64 input) if asked, then ``weights`` if asked.

    Raises:
        ShapeError: any bad shape, dtype or option, naming the argument.

    >>> import numpy as np, qkv
    >>> x = np.array([[1., 0.], [0., 1.], [1., 1.]])
    >>> qkv.attention(x, x, x).round(3)
    array([[0.802, 0.599],
           [0.599, 0.802],
           [0.752, 0.752]])
    """
    try:
        o = opts.bind("attention", options, FORWARD)  # torch's is_causal=, attn_mask=, ...: qkv's names
        opts.parse_flag("return_lse", o["return_lse"])
        call = _prepared(q, k, v, o["method"], o["return_weights"], o)
    except ShapeError as err:
        raise type(err)(str(err)) from None  # the caller's line, not our internals
    return call.forward(o["return_lse"], o["return_weights"])


attention.__signature__ = opts.signature(("q", "k", "v"), FORWARD)


def attention_backward(dout, q, k, v, out, lse, *, dlse=None, return_dbias=False, **options):
    """Gradients ``(dq, dk, dv)`` of ``attention`` given ``dout = ∂L/∂out``; with
    ``return_dbias=True`` also the bias's, ``(dq, dk, dv, dbias)``.

    ``out`` and ``lse`` are what ``attention(..., return_lse=True)`` returned for the same
    q, k, v and options (recomputing P from lse is how the tiled backward avoids storing
    the weights). Each gradient has its input's shape and dtype; broadcast axes and the
    query heads sharing a kv head under ``gqa`` are summed. Rows that attended to nothing
    and keys past ``kv_lengths`` get gradient 0.

    With ``dlse = ∂L/∂lse`` (a loss that uses the returned lse too; ``∂lse_i/∂s_ij = P_ij``)
    the score gradient is ``dS = P ∘ (dP - delta + dlse)``.

    **The bias's gradient** (a learned bias: T5's relative positions) is ``dS`` itself, the
    gradient of the scores ``S = softcap(scale·q·kᵀ) + bias`` (the bias is added after the
    softcap, so its slope does not apply; with dropout ``dP = Z ∘ (dO Vᵀ)`` as for dq),
    summed over the axes along which the bias was broadcast: ``dbias`` has the bias's shape
    and dtype, 0 where a query may not attend. It is computed beside any kernel from the
    saved out and lse, one ``(Tq, Tk)`` block of one batch item and head at a time
    (:mod:`qkv.kernels.bias_grad`): memory of the bias and one block.

    Args:
        dout: ``(..., Hq, Tq, Dv)``, the shape of ``out``.
        q, k, v, mask, bias, ..., method: exactly as passed to :func:`attention`.
        out: ``(..., Hq, Tq, Dv)``. lse: ``(..., Hq, Tq)``.
        dlse: ``(..., Hq, Tq)`` or None (0).
        return_dbias: also return ``dbias`` (needs ``bias=``).

    Returns:
        ``(dq, dk, dv)`` with the shapes and dtypes of ``(q, k, v)``, then ``dbias`` if asked.

    >>> import numpy as np, qkv
    >>> x, bias = np.eye(2), np.zeros((2, 2))
    >>> out, lse = qkv.attention(x, x, x, bias=bias, return_lse=True)
    >>> dout = np.array([[1., 0.], [0., 0.]])          # the loss: out[0, 0] = P[0, 0]
    >>> qkv.attention_backward(dout, x, x, x, out, lse, bias=bias, return_dbias=True)[3].round(3)
    array([[ 0.221, -0.221],
           [ 0.   ,  0.   ]])
    """
    try:
        o = opts.bind("attention_backward", options, BACKWARD)
        call = _prepared(q, k, v, o["method"], False, o)
    except ShapeError as err:
        raise type(err)(str(err)) from None
    return call.backward(dout, out, lse, dlse, return_dbias)


attention_backward.__signature__ = opts.signature(("dout", "q", "k", "v", "out", "lse"), BACKWARD,
                                                  before=(("dlse", None), ("return_dbias", False)))
