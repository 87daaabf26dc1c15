"""Griffin's recurrent block with its RG-LRU (transformers' ``RecurrentGemmaRecurrentBlock``) as a
trainable NumPy layer.

Forward, for ``x (B, T, d_model)`` and an LRU of width ``L`` split into ``H`` blocks of
``L/H`` channels (the gates are block-diagonal: one ``(L/H, L/H)`` matrix a block)::

    y  = gelu_tanh(x W_y + b_y)                             (B, T, L)   the gate branch
    u  = conv(x W_x + b_x)                                  short causal depthwise conv (with bias)
    i_t = sigmoid(u_t W_i + b_i),  r_t = sigmoid(u_t W_r + b_r)       per block
    log a_t = -c softplus(Λ) r_t,   c = 8                   a_t in (0, 1]
    h_t = a_t ∘ h_{t-1} + m_t ∘ i_t ∘ u_t,   m_t = sqrt(1 - a_t²)       (m = 1 at position 0)
    out = (h ∘ y) W_out + b_out

The recurrence is :func:`qkv.recurrent.linear_scan` (``x = m ∘ i ∘ u``, ``log_a``). Position 0 of
a sequence resets the state as transformers does (``a = 0``, ``m = 1``): the state before it is
zero, so only ``m`` changes.

**The square root's derivative.** By default it is bounded as transformers'
``SqrtBoundDerivative`` bounds it (``sqrt_grad_bound=1000``)::

    dm/d(1 - a²) = 1 / sqrt(max(4 (1 - a²), 1 / bound²))     (the true one: 1 / (2 sqrt(1 - a²)))

so where ``1 - a² < 1/(4·bound²) = 2.5e-7`` (``a`` within ``1.25e-7`` of 1: a slow channel
with its gate open) the gradient through ``m`` to ``log a``, the recurrence gate and ``Λ`` is
smaller than the true one, by the factor ``2·bound·sqrt(1 - a²)``, and no longer matches
finite differences. ``sqrt_grad_bound=None`` takes the true derivative (bounded only where
``1 - a²`` is below the dtype's smallest normal number, where the true one is infinite).
The forward is the same either way. See docs/recurrent-layers.md.

**Decoding.** ``new_state(batch)`` holds the convolution's last ``K - 1`` inputs and
``h (B, L)``; ``forward(x_new, state=state)`` continues the sequence from position
``state.length`` (so a fresh state starts at position 0, with its reset).
"""
from __future__ import annotations

import math

import numpy as np

from .. import recurrent
from ..errors import ShapeError, positive_int
from . import fusion
from .activations import gelu_tanh_backward, gelu_tanh_forward, sigmoid
from .base import Layer, check_input, linear_grad
from .hf_variants import RGLRU_NEEDS
from .recurrent_parts import (RecurrentState, check_state, compute_dtype, conv_backward, conv_forward, conv_tail,
                              grad_output, hf_tensors, load_hf, softplus)

C_EXPONENT = 8.0          # Griffin's c
MAX_SQRT_GRADIENT = 1000.0  # transformers' bound on d sqrt(x) / dx


def check_sqrt_grad_bound(bound):
    """``None`` or a positive finite number (a ShapeError naming it otherwise)."""
    if bound is None:
        return None
    if isinstance(bound, (bool, np.bool_)) or not isinstance(bound, (int, float, np.integer, np.floating)) \
            or not math.isfinite(bound) or bound <= 0:
        raise ShapeError(f"sqrt_grad_bound must be None (the true derivative) or a positive finite number "
                         f"(transformers': {MAX_SQRT_GRADIENT:g}); got {bound!r}")
    return float(bound)


class RGLRU(Layer):
    """Griffin's recurrent block: LRU width ``lru_width`` in ``n_heads`` gate blocks, conv of ``conv_width``.

    Parameters (``x @ W + b``; ``L = lru_width``, ``w = L / n_heads``)::

        W_y (d_model, L)  b_y (L,)   W_x (d_model, L)  b_x (L,)   conv_weight (L, K)  conv_bias (L,)
        input_gate_weight (H, w, w)      input_gate_bias (H, w)
        recurrent_gate_weight (H, w, w)  recurrent_gate_bias (H, w)   recurrent_param (L,)  (Λ)
        W_out (L, d_model)  b_out (d_model,)

    ``sqrt_grad_bound``: transformers' bound on ``d sqrt(x)/dx`` (1000, the default), or None
    for the true derivative (the module docstring says where they differ).
    """

    def __init__(self, d_model: int, lru_width: int, n_heads: int, *, conv_width: int = 4, dtype=np.float32,
                 rng: np.random.Generator | None = None, sqrt_grad_bound: float | None = MAX_SQRT_GRADIENT):
        super().__init__(dtype=dtype, rng=rng)
        self.sqrt_grad_bound = check_sqrt_grad_bound(sqrt_grad_bound)
        self.d_model, self.lru_width = positive_int("d_model", d_model), positive_int("lru_width", lru_width)
        self.n_heads, self.conv_width = positive_int("n_heads", n_heads), positive_int("conv_width", conv_width)
        if self.lru_width % self.n_heads:
            raise ShapeError(f"lru_width must be a multiple of n_heads; got lru_width = {lru_width}, "
                             f"n_heads = {n_heads}")
        L, H, w = self.lru_width, self.n_heads, self.lru_width // self.n_heads
        self._add("W_y", (self.d_model, L))
        self._add("b_y", (L,), zero=True)
        self._add("W_x", (self.d_model, L))
        self._add("b_x", (L,), zero=True)
        self._add("conv_weight", (L, self.conv_width), std=1 / math.sqrt(self.conv_width))
        self._add("conv_bias", (L,), zero=True)
        for gate in ("input_gate", "recurrent_gate"):
            self._add(f"{gate}_weight", (H, w, w), std=1 / math.sqrt(w))
            self._add(f"{gate}_bias", (H, w), zero=True)
        # Λ with a = sigmoid(Λ)^c in [0.9, 0.999] at r = 1 (Griffin's init): softplus(Λ) = -log(a)/c
        a = self.rng.uniform(0.9, 0.999, L)
        self._add("recurrent_param", (L,), zero=True)
        self.params["recurrent_param"][...] = np.log(np.expm1(-np.log(a) / C_EXPONENT))
        self._add("W_out", (L, self.d_model))
        self._add("b_out", (self.d_model,), zero=True)

    @property
    def _cd(self) -> np.dtype:
        return compute_dtype(self.dtype)

    def _p(self, name):
        return self.params[name].astype(self._cd, copy=False)

    def new_state(self, batch: int) -> RecurrentState:
        """An empty :class:`~qkv.nn.RecurrentState`: conv ``(B, K-1, L)``, recurrent ``h (B, L)``."""
        b = positive_int("batch", batch)
        return RecurrentState((b, self.conv_width - 1, self.lru_width), (b, self.lru_width), self._cd)

    # --- forward / backward --------------------------------------------------------------------
    def _gate(self, u: np.ndarray, name: str) -> np.ndarray:
        """``sigmoid`` of the block-diagonal product: ``(B, T, L) -> (B, T, L)``."""
        B, T, L = u.shape
        H = self.n_heads                                 # a product a head through BLAS: einsum's own loop
        uh = u.reshape(B * T, H, L // H).transpose(1, 0, 2)                    # was 40% of a width-128 MQAR step
        pre = np.matmul(uh, self._p(f"{name}_weight")).transpose(1, 0, 2)      # (H,BT,w) @ (H,w,w) -> (BT,H,w)
        return sigmoid(pre + self._p(f"{name}_bias")).reshape(B, T, L)

    def _gate_backward(self, dpre: np.ndarray, u: np.ndarray, name: str) -> np.ndarray:
        """Fill the gate's grads from its pre-activation's gradient ``dpre (B, T, L)``; return its part of ``du``."""
        B, T, L = u.shape
        H, w = self.n_heads, L // self.n_heads
        dpre = dpre.reshape(B * T, H, w).transpose(1, 0, 2)                          # (H, BT, w)
        uh = u.reshape(B * T, H, w).transpose(1, 0, 2)                                 # (H, BT, w)
        self.grads[f"{name}_weight"][...] = np.matmul(uh.transpose(0, 2, 1), dpre)     # (H,w,BT) @ (H,BT,w) -> (H,w,w)
        self.grads[f"{name}_bias"][...] = dpre.sum(axis=1)
        du = np.matmul(dpre, self._p(f"{name}_weight").transpose(0, 2, 1))           # (H,BT,w) @ (H,w,w)ᵀ -> (H,BT,w)
        return du.transpose(1, 0, 2).reshape(B, T, L)

    def forward(self, x, *, state: RecurrentState | None = None) -> np.ndarray:
        """``x (B, T, d_model)`` (or ``(T, d_model)``) -> ``(B, T, d_model)``; ``state`` continues a sequence."""
        x3, squeezed = check_input("x", x, self.d_model, empty=True)
        x3 = x3.astype(self._cd, copy=False)
        Bsz, T, _ = x3.shape
        check_state(self, state, Bsz)
        flat = x3.reshape(-1, self.d_model)
        ypre = (flat @ self._p("W_y") + self._p("b_y")).reshape(Bsz, T, self.lru_width)     # (BT,d) @ (d,L) -> (B,T,L)
        ybr, gelu_saved = gelu_tanh_forward(ypre)
        xpre = (flat @ self._p("W_x") + self._p("b_x")).reshape(Bsz, T, self.lru_width)     # (BT,d) @ (d,L) -> (B,T,L)
        prefix = None if state is None else state.conv.copy()
        u, padded = conv_forward(xpre, self._p("conv_weight"), self._p("conv_bias"), prefix)
        gi, gr = self._gate(u, "input_gate"), self._gate(u, "recurrent_gate")
        sp = softplus(self._p("recurrent_param"))
        log_a = -C_EXPONENT * sp * gr                                          # (B, T, L), <= 0
        one_minus = -np.expm1(2 * log_a)                                       # 1 - a²
        m = np.sqrt(one_minus)
        start = 0 if state is None else state.length
        if start == 0:
            m[:, :1] = 1.0                                                      # the reset at position 0
        xin = m * gi * u
        h0 = None if state is None else state.recurrent.copy()
        h, h_T = recurrent.linear_scan(xin, log_a, initial_state=h0, return_state=True)
        hy = h * ybr
        out = (hy.reshape(-1, self.lru_width) @ self._p("W_out") + self._p("b_out")).reshape(Bsz, T, self.d_model)
        if state is not None:
            state.conv[...] = conv_tail(padded, self.conv_width)
            state.recurrent[...] = h_T
            state.length += T
        self._keep(dict(x=x3, gelu=gelu_saved, ybr=ybr, padded=padded, u=u, gi=gi, gr=gr, sp=sp, log_a=log_a,
                        one_minus=one_minus, m=m, reset=start == 0, xin=xin, h0=h0, h=h, hy=hy, squeezed=squeezed))
        out = out.astype(self.dtype, copy=False)
        return out[0] if squeezed else out

    def _gates_backward(self, s: dict, dxin: np.ndarray, dlog_a: np.ndarray):
        """``(du, dpre_i, dpre_r, dlog_a)``: the gradients through ``xin = m ∘ i ∘ u`` and ``log a``
        to ``u``'s direct use, the two gates' pre-activations and ``log a`` (with the fast extra
        one compiled pass, :func:`qkv.nn.fused.rglru_backward`, NumPy's bits)."""
        bound = self.sqrt_grad_bound
        lim = 1 / bound ** 2 if bound is not None else float(np.finfo(s["u"].dtype).tiny)
        e2 = np.exp(2 * s["log_a"])                                            # a²: d(1 - a²)/dlog a = -2a²
        csp = -C_EXPONENT * s["sp"]
        arrays = [np.ascontiguousarray(s[n]) for n in ("m", "gi", "gr", "u", "one_minus")]
        dxin, dlog_a = np.ascontiguousarray(dxin), np.array(dlog_a, order="C")
        mod = fusion.compiled(dxin, dlog_a, *arrays, e2)
        if mod is not None:
            out = [np.empty_like(dxin) for _ in range(3)]
            consts = np.array([1, 2, 4, lim, 0], dtype=dxin.dtype)
            mod.rglru_backward(dxin, dlog_a, *arrays, e2, np.ascontiguousarray(csp, dtype=dxin.dtype), consts,
                               bool(s["reset"]), *out)
            return (*out, dlog_a)
        m, gi, gr, u, one_minus = arrays
        du = dxin * m * gi
        dgi = dxin * m * u
        dm = dxin * gi * u
        if s["reset"]:
            dm[:, :1] = 0.0                                                     # m = 1 there, a constant
        d_one_minus = dm / np.sqrt(np.maximum(4 * one_minus, lim))
        dlog_a = dlog_a - d_one_minus * 2 * e2
        dgr = dlog_a * csp
        return du, dgi * gi * (1 - gi), dgr * gr * (1 - gr), dlog_a

    def backward(self, dy) -> np.ndarray:
        """Fill ``grads`` from ``dy`` (the output's shape); return ``dx``."""
        s = self._need_saved()
        x3 = s["x"]
        Bsz, T, _ = x3.shape
        L = self.lru_width
        dy = grad_output(dy, x3.shape, s["squeezed"]).astype(self._cd, copy=False)
        self.grads["W_out"][...] = linear_grad(s["hy"], dy)
        self.grads["b_out"][...] = dy.sum(axis=(0, 1))
        dhy = (dy.reshape(-1, self.d_model) @ self._p("W_out").T).reshape(Bsz, T, L)  # (BT,d) @ (d,L) -> (BT,L)
        dh, dypre = dhy * s["ybr"], gelu_tanh_backward(dhy * s["h"], s["gelu"])
        dxin, dlog_a, _ = recurrent.linear_scan_backward(dh, s["xin"], s["log_a"], initial_state=s["h0"])
        du, dpi, dpr, dlog_a = self._gates_backward(s, dxin, dlog_a)
        self.grads["recurrent_param"][...] = np.einsum("btl,btl->l", dlog_a, s["gr"]) * (
            -C_EXPONENT * sigmoid(self._p("recurrent_param")))
        du += self._gate_backward(dpi, s["u"], "input_gate")
        du += self._gate_backward(dpr, s["u"], "recurrent_gate")
        dxpre, self.grads["conv_weight"][...], self.grads["conv_bias"][...] = conv_backward(
            du, s["padded"], self._p("conv_weight"))
        for name, d in (("y", dypre), ("x", dxpre)):
            self.grads[f"W_{name}"][...] = linear_grad(x3, d)
            self.grads[f"b_{name}"][...] = d.sum(axis=(0, 1))
        dx = dypre.reshape(-1, L) @ self._p("W_y").T + dxpre.reshape(-1, L) @ self._p("W_x").T  # (BT,L) @ (L,d)
        dx = dx.reshape(x3.shape).astype(self.dtype, copy=False)
        return dx[0] if s["squeezed"] else dx

    # --- transformers --------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, module, *, dtype=np.float32, sqrt_grad_bound: float | None = MAX_SQRT_GRADIENT) -> RGLRU:
        """The layer of a transformers ``RecurrentGemmaRecurrentBlock``, weight for weight (shapes
        checked); ``sqrt_grad_bound`` as in the constructor (transformers' by default)."""
        t = hf_tensors(module, "RGLRU.from_hf", "RecurrentGemmaRecurrentBlock", RGLRU_NEEDS)
        import torch
        probe = np.linspace(-3, 3, 13)
        got = module.act_fn(torch.tensor(probe)).numpy()
        if np.max(np.abs(got - gelu_tanh_forward(probe)[0])) > 1e-12:
            raise ShapeError(f"RGLRU.from_hf: the gate branch's activation must be tanh GELU "
                             f"(gelu_pytorch_tanh); got {type(module.act_fn).__name__}")
        layer = cls(module.hidden_size, module.lru_width, module.rg_lru.num_attention_heads,
                    conv_width=module.conv1d_width, dtype=dtype, sqrt_grad_bound=sqrt_grad_bound)
        same = lambda a: a  # noqa: E731
        table = {"linear_y.weight": ("W_y", np.transpose), "linear_y.bias": ("b_y", same),
                 "linear_x.weight": ("W_x", np.transpose), "linear_x.bias": ("b_x", same),
                 "linear_out.weight": ("W_out", np.transpose), "linear_out.bias": ("b_out", same),
                 "conv_1d.weight": ("conv_weight", lambda w: w[:, 0, :]), "conv_1d.bias": ("conv_bias", same),
                 "rg_lru.recurrent_param": ("recurrent_param", same)}
        for gate in ("input_gate", "recurrent_gate"):
            table.update({f"rg_lru.{gate}_weight": (f"{gate}_weight", same),
                          f"rg_lru.{gate}_bias": (f"{gate}_bias", same)})
        load_hf(layer, t, table, "RGLRU.from_hf")
        return layer
