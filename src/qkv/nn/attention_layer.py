"""The one base of the attention layers: options, projections, checks, caches, the attention call.

:class:`~qkv.nn.SelfAttention`, :class:`~qkv.nn.MultiHeadAttention`,
:class:`~qkv.nn.LatentAttention` and :class:`~qkv.nn.LinearAttention` (and
``qkv.distributed.RingMultiHeadAttention`` on top of MultiHeadAttention) differ in how they
make q, k and v, in the attention they call and in what a cache or state stores. What
surrounds that is the same and lives here, said once:

- the options (``causal`` and ``window`` parsed in the constructor, so a bad value fails
  there and not at the first forward; ``rope_base`` checked when RoPE is on) and the
  keyword arguments of :func:`qkv.attention` / :func:`qkv.attention_backward` built from
  them, with a cached call aligned bottom-right (the newest query sees the newest key);
- the projections: one :class:`~qkv.nn.Linear` each, whose ``W`` (and ``b``) appear in
  the layer's flat ``params``/``grads`` as ``W_<name>`` (``b_<name>``);
- the checks of ``x``, ``context`` and ``dy`` (a 2-D ``(T, d_model)`` input is one
  sequence, given back 2-D), and the guards of ``cache=``.
"""
from __future__ import annotations

import math

import numpy as np

from ..api import attention, attention_backward, prepare_call
from ..errors import ShapeError, as_float_array, fmt_shape, positive_int
from ..options import parse_dropout, parse_softcap
from . import products
from .base import Layer, check_input, linear_grad, merge_heads, split_heads
from .checks import attention_options, cache_step, check_cache, check_context, mask_options, rope_options
from .layers import Linear
from ..threads import one_thread_if

FUSE_ROWS = 256  # B*T from which self-attention's three projections run as one product
PREPARED = "_prepared"  # the key of a forward's prepared call (qkv.api.Prepared) in its options (see _attend)
# A layer's attention of fewer score entries (B·H·Tq·Tk) than this runs on the calling thread
# where the layer's projections ran on OpenBLAS's threads: those spin on after a product and
# hold the second core, so a kernel thread started then costs more than it saves (nanoGPT's
# CPU recipe, (12, 4, 64, 32), inside the training step). Where the projections run on
# numba's threads (qkv.nn.products.pooled) the attention takes them too, as a bare
# qkv.attention call does (qkv.kernels.rows.kernel.SERIAL_WORK).
LAYER_SERIAL_WORK = 1 << 18


class AttentionLayer(Layer):
    """Base of the attention layers (see the module docstring); not a layer by itself.

    A subclass sets ``cache_type`` (the :class:`~qkv.nn.Cache` its ``new_cache`` makes)
    and ``grouped`` (True: inputs are ``(B, H, T, D)`` and query heads share kv heads as
    ``gqa=True`` says), makes its projections with :meth:`_linears`, and writes
    ``forward``/``backward`` from the helpers below.
    """

    cache_type: type | None = None
    grouped = True

    def __init__(self, d_model: int, *, causal=False, align=None, window=None, chunk=None,
                 scale: float | None = None, softcap=None, dropout: float = 0.0, dtype=np.float32,
                 rng: np.random.Generator | None = None):
        super().__init__(dtype=dtype, rng=rng)
        self.d_model = positive_int("d_model", d_model)
        mask_options(causal, align, window, chunk)  # a bad value fails here, not at the first forward
        self.causal, self.align, self.window, self.chunk, self.scale = causal, align, window, chunk, scale
        self.softcap = parse_softcap(softcap)
        self.dropout = parse_dropout(dropout, 0)[0]  # the rate; each training call draws its seed
        self.alibi = None  # ALiBi slopes (n_heads,) where a layer offers them

    def _check_rope_base(self, used: bool, rope_base) -> None:
        """``rope_base`` must be a number > 1 when RoPE is on (unused, it is not checked)."""
        self.rope_base = rope_options(used, 0, rope_base)  # 0: no even-width test (MLA's d_rope)

    def _linears(self, *, bias: bool = False, **shapes: tuple[str, int, int]) -> None:
        """``attr=(name, d_in, d_out)``: ``self.attr = Linear(d_in, d_out)``, shown as ``W_name`` (``b_name``).

        The Linears are made in the order given, drawing from the layer's Generator, so a
        seed gives the same arrays as it always did; every weight name comes before the biases.
        """
        links, bias_links = {}, {}
        for attr, (name, d_in, d_out) in shapes.items():
            layer = Linear(d_in, d_out, bias=bias, dtype=self.dtype, rng=self.rng)
            setattr(self, attr, layer)
            links[f"W_{name}"] = (layer, "W")
            if bias:
                bias_links[f"b_{name}"] = (layer, "b")
        self._expose({**links, **bias_links})

    # --- forward -------------------------------------------------------------------------
    def _heads(self, x3: np.ndarray, src: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``q (B, Hq, T, D)`` from ``x3`` and ``k``, ``v (B, Hkv, Tk, D)`` from the key/value
        source ``src``, through ``q_proj``, ``k_proj``, ``v_proj`` (layers with ``n_heads`` and
        ``n_kv_heads``: MultiHeadAttention, LinearAttention)."""
        if src is x3 and x3.shape[0] * x3.shape[1] >= FUSE_ROWS:
            q, k, v = self._fused_projections(x3)
        else:
            q, k, v = self.q_proj.forward(x3), self.k_proj.forward(src), self.v_proj.forward(src)
        # (B,T,Hq*D) -> (B,Hq,T,D); (B,Tk,Hkv*D) -> (B,Hkv,Tk,D)
        return split_heads(q, self.n_heads), split_heads(k, self.n_kv_heads), split_heads(v, self.n_kv_heads)

    def _fused_projections(self, x3: np.ndarray):
        """Self-attention's ``x W_Q``, ``x W_K``, ``x W_V`` (+ biases) as one product against the
        three matrices side by side: OpenBLAS runs (4096, 384) @ (384, 1152) at 1.2x the rate of
        three (384, 384) products. Each Linear keeps ``x`` for its backward, as its own forward would."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        w = np.concatenate([p.params["W"] for p in projs], axis=1)  # (d_model, Σ d_out)
        y = products.matmul(x3.reshape(-1, x3.shape[-1]), w)  # (B·T, d_model) @ (d_model, Σ d_out): one 2-D product
        y = y.reshape(x3.shape[:-1] + (w.shape[1],))
        if self.q_proj.bias:  # _linears gives all of a layer's projections a bias, or none
            y += np.concatenate([p.params["b"] for p in projs])
        for p in projs:
            p._keep(x3)
        cuts = np.cumsum([0] + [p.d_out for p in projs])
        return [y[..., a:b] for a, b in zip(cuts[:-1], cuts[1:])]  # views of y's column blocks

    def _input(self, name: str, x) -> tuple[np.ndarray, bool]:
        """``x`` as ``(B, T, d_model)`` in the layer's dtype, and whether it came 2-D."""
        x3, squeezed = check_input(name, x, self.d_model)
        return x3.astype(self.dtype, copy=False), squeezed

    def _context(self, context, x, x3: np.ndarray, squeezed: bool) -> np.ndarray:
        """Cross-attention's ``context (B, Tc, d_model)``, given like ``x`` (2-D or 3-D, same B)."""
        src, _ = self._input("context", context)
        check_context(np.shape(x), np.shape(context))
        return src

    def _check_cache(self, cache, *, cross: bool = False) -> None:
        """``cache`` is None, or this layer's kind of cache on a causal self-attention call."""
        check_cache(cache, self.new_cache, causal=self.causal, cross=cross)

    def _options(self, kv_lengths=None, q_lengths=None, cached: bool = False) -> dict:
        """Keyword arguments of qkv.attention/attention_backward for one call; a cached call
        is aligned bottom-right (each sequence's newest query sees its newest key). In
        ``train()`` mode with ``dropout`` the call drops weights with a fresh seed."""
        drop = {}
        if self.training and self.dropout:  # a seed from the layer's Generator, kept with opts for backward
            drop = dict(dropout_p=self.dropout, dropout_seed=int(self.rng.integers(2 ** 63)))
        return attention_options(causal=self.causal, align=self.align, window=self.window, chunk=self.chunk,
                                 alibi=self.alibi, scale=self.scale, gqa=self.grouped,
                                 kv_lengths=kv_lengths, q_lengths=q_lengths, cached=cached,
                                 softcap=self.softcap, **drop)

    _cache_step = staticmethod(cache_step)

    @staticmethod
    def _new_keys(dk: np.ndarray, start, t: int) -> np.ndarray:
        """The gradient rows of this call's ``t`` keys ``(B, H, t, D)`` out of ``dk`` over the cache."""
        if isinstance(start, (int, np.integer)):
            return dk[:, :, start:]
        out = np.zeros(dk.shape[:2] + (t,) + dk.shape[3:], dk.dtype)
        for b, s0 in enumerate(start):
            n = min(t, dk.shape[2] - s0)
            out[b, :, :n] = dk[b, :, s0:s0 + n]
        return out

    def _attend(self, q, k, v, opts: dict, return_weights: bool, *, lse: bool = True):
        """``(out, lse or None, weights or None)`` of :func:`qkv.attention` with ``opts``.

        A call that keeps lse for its backward keeps its prepared call too (a
        :class:`qkv.api.Prepared`, in ``opts`` under :data:`PREPARED`): :meth:`_attend_backward`
        runs its backward without checking again the layer's own q, k, v and options (in
        nanoGPT's training step that was 90 µs of 1.5 ms an attention backward)."""
        if lse and not return_weights:
            call = prepare_call(q, k, v, **opts)
            with _threads(call.problem):
                out, lse_ = call.forward(return_lse=True)
            opts[PREPARED] = call
            return out, lse_, None
        res = attention(q, k, v, return_lse=lse, return_weights=return_weights, **opts)
        res = list(res) if isinstance(res, tuple) else [res]  # out, then lse and weights as asked
        out = res.pop(0)
        return out, (res.pop(0) if lse else None), (res.pop(0) if return_weights else None)

    @staticmethod
    def _output(y: np.ndarray, weights, squeezed: bool, return_weights: bool):
        """``y`` (and the weights), 2-D again where the input was."""
        if squeezed:
            y, weights = y[0], (None if weights is None else weights[0])
        return (y, weights) if return_weights else y

    # --- backward ------------------------------------------------------------------------
    def _grad_output(self, dy, want: tuple, layout: str) -> np.ndarray:
        """``dy`` in the layer's dtype if it has the output's shape ``want``, else a ShapeError."""
        dy = as_float_array("dy", dy)
        if dy.shape != want:
            raise ShapeError(f"dy must have the output's shape {layout} = {fmt_shape(want)}; got {fmt_shape(dy.shape)}")
        return dy.astype(self.dtype, copy=False)

    def _grad_sequences(self, dy, shape: tuple, squeezed: bool) -> np.ndarray:
        """``dy`` of a ``(B, T, d_model)`` output (``shape``) as 3-D, given 2-D where ``x`` was."""
        dy = self._grad_output(dy, shape[1:] if squeezed else shape, "(B, T, d_model)")
        return dy[None] if squeezed else dy

    def _heads_backward(self, dq, dk, dv, cross: bool, squeezed: bool):
        """The inverse of :meth:`_heads`: fills the projections' grads and returns ``dx``, or
        ``(dx, dcontext)`` for cross-attention (self-attention's x fed all three), 2-D where
        the input was."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if not cross and projs[0]._saved is projs[1]._saved is projs[2]._saved and dq.shape[-1] == dv.shape[-1]:
            dx = self._fused_projections_backward(dq, dk, dv)
            return dx[0] if squeezed else dx
        dx = self.q_proj.backward(merge_heads(dq))  # (B,Hq,T,D) -> (B,T,Hq*D) -> (B,T,d_model)
        dsrc = self.k_proj.backward(merge_heads(dk)) + self.v_proj.backward(merge_heads(dv))  # (B,Tk,d_model)
        if cross:
            return (dx[0], dsrc[0]) if squeezed else (dx, dsrc)
        dx = dx + dsrc
        return dx[0] if squeezed else dx

    def _fused_projections_backward(self, dq, dk, dv) -> np.ndarray:
        """Self-attention's three projections backward as two products (one ``dW`` for the
        three matrices side by side, one ``dx``), as :meth:`_fused_projections` runs the
        forward: the heads' gradients go straight into one ``(B, T, Σ d_out)`` array."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        x = projs[0]._need_saved()                                # (B, T, d_model), kept by all three
        b, t, d = x.shape[0], x.shape[1], dq.shape[-1]
        heads = [g.shape[1] for g in (dq, dk, dv)]
        dy = np.empty((b, t, sum(heads), d), self.dtype)
        for g, a, e in zip((dq, dk, dv), np.cumsum([0] + heads[:-1]), np.cumsum(heads)):
            np.copyto(dy[:, :, a:e], np.swapaxes(g, 1, 2))        # (B,H,T,D) -> (B,T,H,D), merged in place
        dy2 = dy.reshape(b * t, -1)                               # (B·T, Σ d_out)
        dw = linear_grad(x, dy2.reshape(b, t, -1))                # (d_model, B·T) @ (B·T, Σ d_out)
        cuts = np.cumsum([0] + [p.d_out for p in projs])
        for p, a, e in zip(projs, cuts[:-1], cuts[1:]):
            np.copyto(p.grads["W"], dw[:, a:e])
            if p.bias:
                p.grads["b"][...] = dy2[:, a:e].sum(axis=0)
        w = np.concatenate([p.params["W"] for p in projs], axis=1)  # (d_model, Σ d_out)
        return products.matmul(dy2, w.T).reshape(x.shape)         # (B·T, Σ d_out) @ (Σ d_out, d_model)

    @staticmethod
    def _attend_backward(dout, q, k, v, out, lse, opts: dict):
        """``(dq, dk, dv)`` of :func:`qkv.attention_backward` with the forward's ``opts`` (on
        the forward's checked problem where :meth:`_attend` kept it)."""
        call = opts.get(PREPARED)
        if call is not None and call.problem.q is q and dout.shape == out.shape:   # the forward's own arrays
            with _threads(call.problem):
                return call.backward(dout, out, lse)
        return attention_backward(dout, q, k, v, out, lse, **{n: x for n, x in opts.items() if n != PREPARED})


def _threads(prob):
    """``kernel_threads(1)`` for a problem of fewer than :data:`LAYER_SERIAL_WORK` score entries
    where the layers' products are not on numba's threads."""
    small = math.prod(prob.spec.lead) * prob.spec.tq * prob.spec.tk < LAYER_SERIAL_WORK
    return one_thread_if(small and not products.pooled())
