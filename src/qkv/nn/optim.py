"""Softmax cross-entropy and the Adam optimizer, in NumPy."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..errors import ShapeError, fmt_shape
from ..numerics import logsumexp


def cross_entropy(logits, targets) -> tuple[float, np.ndarray]:
    """Mean ``-log softmax(logits)[target]`` over rows, and its gradient.

    ``logits (..., C)`` float, ``targets (...)`` int in ``[0, C)``. Returns
    ``(loss, dlogits)`` with ``dlogits = (softmax(logits) - onehot(target)) / N``.

    >>> loss, d = cross_entropy(np.zeros((1, 4)), np.array([2]))
    >>> round(loss, 4), d.round(2).tolist()
    (1.3863, [[0.25, 0.25, -0.75, 0.25]])
    """
    logits = np.asarray(logits)
    targets = np.asarray(targets)
    if logits.shape[:-1] != targets.shape or targets.dtype.kind not in "iu":
        raise ShapeError(f"targets must be ints of shape logits.shape[:-1] = {fmt_shape(logits.shape[:-1])}; "
                         f"got {fmt_shape(targets.shape)} {targets.dtype}")
    if logits.ndim < 1 or logits.size == 0:  # the mean over no rows (or a softmax over no classes) is undefined
        raise ShapeError(f"logits must have at least one row and one class (..., C); got {fmt_shape(logits.shape)}")
    c = logits.shape[-1]
    flat, t = logits.reshape(-1, c), targets.reshape(-1)
    if t.size and (t.min() < 0 or t.max() >= c):
        raise ShapeError(f"targets must lie in [0, C) = [0, {c}); got values from {t.min()} to {t.max()}")
    lse = logsumexp(flat, axis=-1)  # (N,)
    rows = np.arange(t.size)
    loss = float(np.mean(lse - flat[rows, t]))
    d = np.exp(flat - lse[:, None])  # softmax (N, C)
    d[rows, t] -= 1
    return loss, (d / t.size).reshape(logits.shape).astype(logits.dtype, copy=False)


class Adam:
    """Adam (Kingma & Ba, 2015) over the ``params``/``grads`` of a list of layers.

    ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g²``, ``p -= lr · m̂ / (sqrt(v̂) + eps)``
    with the bias corrections ``m̂ = m / (1 - b1^t)``, ``v̂ = v / (1 - b2^t)``. Optional
    decoupled ``weight_decay`` (AdamW) and global gradient-norm clipping ``clip``.
    """

    def __init__(self, layers, lr: float = 1e-3, *, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, clip: float | None = None):
        self.layers = list(layers)
        for n, layer in enumerate(self.layers):
            if not all(isinstance(getattr(layer, name, None), Mapping) for name in ("params", "grads")):
                raise ShapeError(f"layers must be qkv.nn layers (objects with params and grads dicts, as the "
                                 f"optimizer updates layer.params from layer.grads); layers[{n}] is "
                                 f"{type(layer).__name__}")
        self.lr, self.b1, self.b2, self.eps = lr, betas[0], betas[1], eps
        self.weight_decay, self.clip = weight_decay, clip
        self.t = 0
        self.m = [{k: np.zeros_like(p) for k, p in layer.params.items()} for layer in self.layers]
        self.v = [{k: np.zeros_like(p) for k, p in layer.params.items()} for layer in self.layers]

    def step(self, lr: float | None = None) -> float:
        """One update from the layers' current ``grads``; returns the gradient norm."""
        lr = self.lr if lr is None else lr
        self.t += 1
        norm = float(np.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64)))
                                 for layer in self.layers for g in layer.grads.values())))
        factor = 1.0 if self.clip is None or norm <= self.clip else self.clip / (norm + 1e-12)
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        for layer, m, v in zip(self.layers, self.m, self.v):
            for k, p in layer.params.items():
                g = layer.grads[k] * factor
                m[k] = self.b1 * m[k] + (1 - self.b1) * g
                v[k] = self.b2 * v[k] + (1 - self.b2) * g * g
                if self.weight_decay:
                    p -= lr * self.weight_decay * p
                p -= (lr * (m[k] / c1) / (np.sqrt(v[k] / c2) + self.eps)).astype(p.dtype, copy=False)
        return norm
