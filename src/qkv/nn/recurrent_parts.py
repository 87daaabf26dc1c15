"""What the recurrent layers (Mamba-2, Gated DeltaNet, Griffin's RG-LRU) share: the short causal
depthwise convolution, the gated RMSNorms, L2 normalisation, softplus/sigmoid, the decoding
state and the checked copy of a transformers module's weights.

**Short causal depthwise convolution.** Channel c of ``u (B, T, C)`` is filtered by its own
``K`` taps ``w[c] (K,)``, seeing the current token and the ``K - 1`` before it (PyTorch's
``Conv1d(C, C, K, groups=C, padding=K-1)`` cut to the first T outputs)::

    ũ = [prefix | u]                  (B, K-1+T, C)   prefix: zeros, or a decoding state
    y_t = b + Σ_j w[:, j] ∘ ũ_{t+j}   j = 0 .. K-1
    dw[:, j] = Σ_{b,t} dy_t ∘ ũ_{t+j},   dũ_{t+j} += w[:, j] ∘ dy_t,   du = dũ[K-1:]

The next call's prefix is the last ``K - 1`` rows of ũ, which is all a decoding state keeps
of the convolution (constant in T).

**Gated RMSNorm.** With ``r = (mean(h²) + eps)^(-1/2)`` over a group of features and
``ĥ = h r``, ``y = w ∘ ĥ`` has ``dh = r (dĥ - ĥ mean(dĥ ∘ ĥ))`` with ``dĥ = w ∘ dy``.
Mamba-2 normalises ``h = y ∘ silu(z)`` (gate first, ``n_groups`` groups over the width);
Qwen3-Next normalises each head's output and gates after: ``w ∘ ĥ ∘ silu(z)``.

**L2 normalisation** (Gated DeltaNet's q and k): ``y = x r``, ``r = (Σ x² + eps)^(-1/2)``,
``dx = r (dy - y Σ(dy ∘ y))``.
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, as_float_array, fmt_shape
from .activations import silu_backward, silu_forward
from .fusion import compiled


# --- elementwise ------------------------------------------------------------------------------
def softplus(x: np.ndarray) -> np.ndarray:
    """``log(1 + e^x)`` without overflow (its derivative is :func:`sigmoid`)."""
    return np.logaddexp(0.0, x).astype(x.dtype, copy=False)


# --- the short causal depthwise convolution ---------------------------------------------------
def conv_forward(u: np.ndarray, w: np.ndarray, b: np.ndarray | None, prefix: np.ndarray | None):
    """``u (B, T, C)``, taps ``w (C, K)``, bias ``b (C,)`` or None, ``prefix (B, K-1, C)`` or None
    (zeros). Returns ``(y (B, T, C), padded ũ (B, K-1+T, C))``; ``ũ[:, -(K-1):]`` is the next prefix.
    With the fast extra, one compiled pass (:func:`qkv.nn.fused.causal_conv`) instead of K."""
    B, T, C = u.shape
    K = w.shape[1]
    if prefix is None:
        prefix = np.zeros((B, K - 1, C), u.dtype)
    padded = np.concatenate([prefix.astype(u.dtype, copy=False), u], axis=1)  # (B, K-1+T, C)
    fast = compiled(padded)
    if fast is not None:
        y = np.empty_like(padded, shape=u.shape)
        bias = np.zeros(C, u.dtype) if b is None else b.astype(u.dtype)
        fast.causal_conv(padded, np.ascontiguousarray(w.T, dtype=u.dtype), bias, y)
        return y, padded
    y = np.zeros_like(u) if b is None else np.broadcast_to(b.astype(u.dtype), u.shape).copy()
    for j in range(K):
        y += w[:, j] * padded[:, j:j + T]                                      # (C,) ∘ (B,T,C)
    return y, padded


def conv_backward(dy: np.ndarray, padded: np.ndarray, w: np.ndarray):
    """Gradients ``(du (B, T, C), dw (C, K), db (C,))`` of :func:`conv_forward`."""
    T, K = dy.shape[1], w.shape[1]
    fast = compiled(padded)
    if fast is not None:
        dy = np.ascontiguousarray(dy, dtype=padded.dtype)
        du, dwt = np.empty_like(dy), np.zeros((K, dy.shape[-1]))
        fast.causal_conv_backward(dy, padded, np.ascontiguousarray(w.T, dtype=dy.dtype), du, dwt)
        return du, dwt.T.astype(dy.dtype), dy.sum(axis=(0, 1))
    dpadded = np.zeros_like(padded)
    dw = np.empty(w.shape, dy.dtype)
    for j in range(K):
        dw[:, j] = np.einsum("btc,btc->c", dy, padded[:, j:j + T])             # (B,T,C)·(B,T,C) -> (C,)
        dpadded[:, j:j + T] += w[:, j] * dy
    return dpadded[:, K - 1:], dw, dy.sum(axis=(0, 1))


def conv_tail(padded: np.ndarray, k: int) -> np.ndarray:
    """The last ``k - 1`` rows of ``ũ``: the next call's prefix ``(B, K-1, C)``."""
    return padded[:, padded.shape[1] - (k - 1):]


# --- normalisations ---------------------------------------------------------------------------
def rms_forward(h: np.ndarray, eps: float):
    """``ĥ = h r`` over the last axis, ``r = (mean(h²) + eps)^(-1/2)``; returns ``(ĥ, r)``."""
    r = 1.0 / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)
    return h * r, r


def rms_backward(dhat: np.ndarray, hhat: np.ndarray, r: np.ndarray) -> np.ndarray:
    """``dh = r (dĥ - ĥ mean(dĥ ∘ ĥ))``."""
    return r * (dhat - hhat * np.mean(dhat * hhat, axis=-1, keepdims=True))


def gate_then_norm_forward(y: np.ndarray, z: np.ndarray, w: np.ndarray, groups: int, eps: float):
    """Mamba-2's ``w ∘ rms(y ∘ silu(z))`` on ``(..., I)``, the RMS over ``groups`` equal slices of I."""
    sz, silu_saved = silu_forward(z)
    h = y * sz
    shape = h.shape
    hhat, r = rms_forward(h.reshape(shape[:-1] + (groups, shape[-1] // groups)), eps)
    hhat = hhat.reshape(shape)
    return w * hhat, (y, sz, silu_saved, hhat, r, groups)


def gate_then_norm_backward(dout: np.ndarray, saved, w: np.ndarray):
    """Gradients ``(dy, dz, dw)`` of :func:`gate_then_norm_forward`."""
    y, sz, silu_saved, hhat, r, groups = saved
    shape = hhat.shape
    dw = (dout * hhat).reshape(-1, hhat.shape[-1]).sum(axis=0)
    split = shape[:-1] + (groups, shape[-1] // groups)
    dh = rms_backward((dout * w).reshape(split), hhat.reshape(split), r).reshape(shape)
    return dh * sz, silu_backward(dh * y, silu_saved), dw


def norm_then_gate_forward(y: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float):
    """Qwen3-Next's ``w ∘ rms(y) ∘ silu(z)`` over the last axis (one head's features)."""
    yhat, r = rms_forward(y, eps)
    sz, silu_saved = silu_forward(z)
    normed = w * yhat
    return normed * sz, (yhat, r, normed, sz, silu_saved)


def norm_then_gate_backward(dout: np.ndarray, saved, w: np.ndarray):
    """Gradients ``(dy, dz, dw)`` of :func:`norm_then_gate_forward`."""
    yhat, r, normed, sz, silu_saved = saved
    dnormed = dout * sz
    dw = (dnormed * yhat).reshape(-1, yhat.shape[-1]).sum(axis=0)
    dy = rms_backward(dnormed * w, yhat, r)
    return dy, silu_backward(dout * normed, silu_saved), dw


def l2norm_forward(x: np.ndarray, eps: float = 1e-6):
    """``x (Σ x² + eps)^(-1/2)`` over the last axis; returns ``(y, r)``."""
    r = 1.0 / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)
    return x * r, r


def l2norm_backward(dy: np.ndarray, y: np.ndarray, r: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``dx = r (dy - y Σ(dy ∘ y))``, written into ``out`` when given (a view of a larger array)."""
    return np.multiply(r, dy - y * np.sum(dy * y, axis=-1, keepdims=True), out=out)


# --- decoding state ---------------------------------------------------------------------------
class RecurrentState:
    """What a recurrent layer keeps between decoding calls, for ``batch`` sequences.

    ``conv (B, K-1, C)``: the last ``K - 1`` inputs of the short convolution; ``recurrent``:
    the recurrence's state (``(B, H, Dk, Dv)`` for Mamba-2 and Gated DeltaNet, ``(B, D)`` for
    the RG-LRU); ``length``: tokens seen. Its size does not grow with the tokens seen.
    Made by the layer's ``new_state(batch)``; a forward with ``state=`` reads and updates it.
    """

    def __init__(self, conv_shape: tuple, recurrent_shape: tuple, dtype):
        self.conv = np.zeros(conv_shape, dtype)
        self.recurrent = np.zeros(recurrent_shape, dtype)
        self.length = 0

    @property
    def batch(self) -> int:
        return self.recurrent.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held, the same after 1 token or a million."""
        return int(self.conv.nbytes + self.recurrent.nbytes)

    def reset(self) -> None:
        """Forget every token seen."""
        self.conv[...] = 0
        self.recurrent[...] = 0
        self.length = 0

    def __repr__(self) -> str:
        return (f"RecurrentState({self.length} tokens, conv {fmt_shape(self.conv.shape)}, "
                f"recurrent {fmt_shape(self.recurrent.shape)}, {self.nbytes} bytes)")


def check_state(layer, state, batch: int) -> None:
    """``state`` is None or one of ``layer.new_state(batch)``'s kind (shapes and dtype)."""
    if state is None:
        return
    if not isinstance(state, RecurrentState):
        raise ShapeError(f"state must come from this layer's new_state(batch); got {type(state).__name__}")
    want = layer.new_state(batch)
    for name in ("conv", "recurrent"):
        got, need = getattr(state, name), getattr(want, name)
        if got.shape != need.shape or got.dtype != need.dtype:
            raise ShapeError(f"state.{name} must have shape {fmt_shape(need.shape)} and dtype {need.dtype} "
                             f"(this layer's new_state(batch={batch})); got {fmt_shape(got.shape)}, {got.dtype}")


def grad_output(dy, shape: tuple, squeezed: bool) -> np.ndarray:
    """``dy`` checked against the output's shape (2-D when the input was), as ``(B, T, d_model)``."""
    dy = as_float_array("dy", dy)
    want = shape[1:] if squeezed else shape
    if dy.shape != want:
        raise ShapeError(f"dy must have the output's shape {fmt_shape(want)}; got {fmt_shape(dy.shape)}")
    return dy[None] if squeezed else dy


def compute_dtype(dtype) -> np.dtype:
    """float64 layers compute in float64, float16 and float32 ones in float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


# --- transformers weights ---------------------------------------------------------------------
def hf_tensors(module, where: str, kind: str, needs: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Every parameter of a torch module as a float64 NumPy array, by its torch name, after
    checking that it has the attributes ``needs`` of a transformers ``kind``."""
    missing = [n for n in needs if not hasattr(module, n)] if hasattr(module, "named_parameters") else ["parameters"]
    if missing:
        raise ShapeError(f"{where} needs a transformers {kind}; got {type(module).__name__} (no {', '.join(missing)})")
    return {name: p.detach().cpu().double().numpy() for name, p in module.named_parameters()}


def load_hf(layer, tensors: dict[str, np.ndarray], table: dict, where: str) -> None:
    """Copy ``tensors`` into ``layer.params`` by ``table[hf_name] = (our_name, convert)``.

    Every tensor must be named in the table and every one of our parameters filled, each with
    our shape after ``convert`` (a function of the torch array); anything else raises.
    """
    unknown = sorted(set(tensors) - set(table))
    if unknown:
        raise ShapeError(f"{where}: no place for the module's weights {unknown}")
    absent = [f"{hf_name} (for {ours})" for hf_name, (ours, _) in table.items() if hf_name not in tensors]
    if absent:
        raise ShapeError(f"{where}: the module has no weight {', '.join(absent)}")
    filled = set()
    for hf_name, (ours, convert) in table.items():
        value = convert(tensors[hf_name])
        want = layer.params[ours].shape
        if value.shape != want:
            raise ShapeError(f"{where}: {hf_name} {fmt_shape(tensors[hf_name].shape)} must give {ours} "
                             f"{fmt_shape(want)}; got {fmt_shape(value.shape)}")
        layer.params[ours][...] = value
        filled.add(ours)
    missing = sorted(set(layer.params) - filled)
    if missing:
        raise ShapeError(f"{where}: no weight of the module fills {missing}")

