"""Softmax cross-entropy, Adam and AdamW, and nanoGPT's learning-rate schedule, in NumPy."""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import numpy as np

from ..errors import ShapeError, fmt_shape
from ..numerics import logsumexp
from .fusion import compiled, parallel


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
    fast = compiled(np.ascontiguousarray(flat))
    if fast is not None and t.size:
        d = np.empty(flat.shape, flat.dtype)
        loss = fast.softmax_cross_entropy(np.ascontiguousarray(flat), t.astype(np.int64, copy=False), d)
        return float(loss), d.reshape(logits.shape)
    lse = logsumexp(flat, axis=-1)  # (N,)
    rows = np.arange(t.size)
    loss = float(np.mean(lse - flat[rows, t]))
    d = np.exp(flat - lse[:, None])  # softmax (N, C)
    d[rows, t] -= 1
    return loss, (d / t.size).reshape(logits.shape).astype(logits.dtype, copy=False)


TRAINABLE = (np.float32, np.float64)  # the parameter dtypes the optimizers update


def check_trainable(layers, who: str) -> None:
    """A ShapeError unless every parameter of ``layers`` is float32 or float64. The optimizers
    keep their moments in each parameter's dtype, and float16 cannot: ``eps = 1e-8`` is 0
    there, ``v`` underflows, and one step turns most weights to NaN. Mixed precision (float32
    master weights beside float16 ones) is not what these optimizers do: train in float32 and
    cast the trained weights for float16 inference."""
    for n, layer in enumerate(layers):
        for name, p in layer.params.items():
            if p.dtype not in TRAINABLE:
                where = name if len(layers) == 1 else f"layers[{n}].{name}"
                raise ShapeError(f"{who} updates float32 or float64 parameters; {where} is {p.dtype} (its moments "
                                 f"and eps = 1e-8 would underflow to 0 and the step make NaN): train in float32 "
                                 f"and cast the trained weights for {p.dtype} inference")


def check_rate(name: str, value, low: float = 0.0, high: float = math.inf, *, closed: bool = True) -> float:
    """``value`` as a float, or a ShapeError unless it is a finite number in ``[low, high)``
    (``(low, high)`` with ``closed=False``)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (low <= value if closed else low < value) or not value < high:
        raise ShapeError(f"{name} must be a finite number in {'[' if closed else '('}{low:g}, {high:g}); "
                         f"got {value!r}")
    return float(value)


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
        check_trainable(self.layers, "Adam")
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


def decays(name: str, array: np.ndarray, no_decay=()) -> bool:
    """AdamW's default rule: weight decay on matrices (``ndim >= 2``), none on vectors (norms,
    biases) and none on the names in ``no_decay`` (a model lists its embeddings there)."""
    return array.ndim >= 2 and name not in no_decay


class AdamW:
    """AdamW (Loshchilov & Hutter, 2019) over the ``params``/``grads`` of a list of layers, with
    global gradient-norm clipping, in PyTorch's order of operations (``torch.optim.AdamW``)::

        g = g · min(1, clip / (‖g‖ + 1e-6))             clipping by the global norm (clip=)
        p = p (1 - lr · weight_decay)                    decoupled decay, decayed arrays only
        m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g²
        p = p - (lr / (1 - b1^t)) · m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    Which arrays decay: ``decay(layer, name, array) -> bool`` if given, else matrices
    (``ndim >= 2``) except the names in the layer's ``no_decay`` (:class:`qkv.models.GPT`
    lists its token and position embeddings, so the tied LM head is not decayed either);
    vectors (norm weights, biases) never. The updates are in place: arrays taken from
    ``layer.params`` before a step see it.

    ``state_dict()`` gives ``{"step": t, "m/<key>": m, "v/<key>": v}`` (copies; ``<key>`` is the
    parameter's name, ``<i>.<name>`` with more than one layer) and ``load_state_dict`` puts
    them back, so a resumed run repeats the original bit for bit.
    """

    def __init__(self, layers, lr: float = 1e-3, *, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1, clip: float | None = None, decay=None):
        self.layers = list(layers) if isinstance(layers, (list, tuple)) else [layers]
        for n, layer in enumerate(self.layers):
            if not all(isinstance(getattr(layer, name, None), Mapping) for name in ("params", "grads")):
                raise ShapeError(f"layers must be qkv.nn layers or models (with params and grads dicts); "
                                 f"layers[{n}] is {type(layer).__name__}")
        check_trainable(self.layers, "AdamW")
        if clip is not None:
            clip = check_rate("clip (or None)", clip, closed=False)
        self.lr, self.eps = check_rate("lr", lr), check_rate("eps", eps, closed=False)
        self.b1, self.b2 = check_rate("betas[0]", betas[0], high=1.0), check_rate("betas[1]", betas[1], high=1.0)
        self.weight_decay, self.clip = check_rate("weight_decay", weight_decay), clip
        self.t = 0
        self.keys, self.slots = [], []  # one slot per array: (layer, name, m, v, decays)
        for i, layer in enumerate(self.layers):
            no_decay = set(getattr(layer, "no_decay", ()))
            for name, p in layer.params.items():
                d = decay(layer, name, p) if decay is not None else decays(name, p, no_decay)
                self.keys.append(name if len(self.layers) == 1 else f"{i}.{name}")
                self.slots.append((layer, name, np.zeros_like(p), np.zeros_like(p), bool(d)))

    def grad_norm(self) -> float:
        """The global L2 norm of every gradient (float64 sums)."""
        return math.sqrt(sum(float(np.vdot(g.reshape(-1), g.reshape(-1)).real)
                             for layer in self.layers for g in layer.grads.values()))

    def step(self, lr: float | None = None) -> float:
        """One update from the layers' current ``grads`` (clipped first when ``clip`` is set;
        the grads are left unchanged). Returns the global gradient norm before clipping."""
        lr = self.lr if lr is None else check_rate("lr", lr)
        norm = self.grad_norm()
        coef = 1.0 if self.clip is None else min(1.0, self.clip / (norm + 1e-6))
        self.t += 1
        step_size = lr / (1 - self.b1 ** self.t)
        root_c2 = math.sqrt(1 - self.b2 ** self.t)
        shrink = 1.0 - lr * self.weight_decay
        jobs, sizes = [], []  # the compiled updates, run together on the kernel threads below
        for layer, name, m, v, decay in self.slots:
            p, g = layer.params[name], layer.grads[name]
            fast = compiled(p, g, m, v)
            if fast is not None:
                f = p.dtype.type  # scalars in the arrays' dtype: float32 stays float32
                args = (p.reshape(-1), g.reshape(-1), m.reshape(-1), v.reshape(-1), f(coef),
                        f(shrink if decay else 1.0), f(self.b1), f(1 - self.b1), f(self.b2),
                        f(1 - self.b2), f(step_size), f(root_c2), f(self.eps))
                jobs.append(lambda fast=fast, args=args: fast.adamw_update(*args))
                sizes.append(p.size)
                continue
            if coef != 1.0:
                g = g * p.dtype.type(coef)
            if decay and self.weight_decay:
                p *= shrink                                  # decoupled decay first
            m *= self.b1
            m += (1 - self.b1) * g                           # m = b1 m + (1 - b1) g
            v *= self.b2
            v += (1 - self.b2) * (g * g)                     # v = b2 v + (1 - b2) g²
            denom = np.sqrt(v)
            denom /= root_c2
            denom += self.eps                                # sqrt(v̂) + eps
            np.divide(m, denom, out=denom)
            denom *= step_size
            p -= denom                                       # p -= lr m̂ / (sqrt(v̂) + eps)
        parallel(jobs, sizes)
        return norm

    def state_dict(self) -> dict[str, np.ndarray]:
        """``{"step": t (int64 0-d array), "m/<key>": ..., "v/<key>": ...}``, copies of the moments."""
        state = {"step": np.array(self.t, dtype=np.int64)}
        for key, (_, _, m, v, _) in zip(self.keys, self.slots):
            state[f"m/{key}"], state[f"v/{key}"] = m.copy(), v.copy()
        return state

    def load_state_dict(self, state) -> None:
        """Put back what :meth:`state_dict` gave (same keys and shapes, else a ShapeError)."""
        want = {"step"} | {f"{s}/{k}" for k in self.keys for s in "mv"}
        if set(state) != want:
            missing, extra = sorted(want - set(state)), sorted(set(state) - want)
            raise ShapeError(f"an AdamW state must have the keys of this optimizer's state_dict(); "
                             f"missing {missing[:5]}, unknown {extra[:5]}")
        for key, (_, _, m, v, _) in zip(self.keys, self.slots):
            for slot, array in (("m", m), ("v", v)):
                new = np.asarray(state[f"{slot}/{key}"])
                if new.shape != array.shape or new.dtype != array.dtype:  # a cast would change the run's bits
                    raise ShapeError(f"{slot}/{key} must be {array.dtype} of shape {fmt_shape(array.shape)} "
                                     f"(its parameter's); got {new.dtype} {fmt_shape(new.shape)}")
                array[...] = new
        self.t = int(np.asarray(state["step"]))


def cosine_lr(step: int, *, lr: float, warmup: int, max_steps: int, min_lr: float) -> float:
    """nanoGPT's schedule: linear warmup to ``lr``, cosine decay to ``min_lr`` at ``max_steps``, then flat.

    ``lr (step + 1) / (warmup + 1)`` for ``step < warmup``; ``min_lr`` after ``max_steps``;
    between them ``min_lr + (lr - min_lr) (1 + cos(π r)) / 2``, ``r = (step - warmup) / (max_steps - warmup)``.

    >>> [round(cosine_lr(s, lr=1.0, warmup=2, max_steps=6, min_lr=0.1), 3) for s in (0, 1, 2, 4, 6, 9)]
    [0.333, 0.667, 1.0, 0.55, 0.1, 0.1]
    """
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step > max_steps or max_steps <= warmup:
        return min_lr
    ratio = (step - warmup) / (max_steps - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
