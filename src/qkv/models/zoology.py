"""Zoology's ``LanguageModel`` (``zoology/model.py``) over qkv's mixers: the network the MQAR
experiment trains (:mod:`qkv.experiments.mqar`), built as Zoology's MQAR configs build theirs.
The mixers are :mod:`qkv.nn`'s (attention, :mod:`qkv.nn.zoology`'s BaseConv and Based, the
recurrent layers); this file is the blocks, norms, embedding and tied head around them.
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, positive_int
from ..nn.base import Layer, linear_grad
from ..nn.multihead import MultiHeadAttention
from ..nn.products import matmul, one_pool
from ..nn.short_conv import BaseConv, ConvAttention

__all__ = ["ZoologyLM"]


class ZoologyLM(Layer):
    """Zoology's ``LanguageModel`` (``zoology/model.py``) over qkv mixers: token embedding (no
    positions), ``len(mixers)`` blocks, a final LayerNorm and the head tied to the embedding.

    ``block="transformer"`` is Zoology's ``TransformerBlock`` with its MQAR configs' state mixer,
    ``torch.nn.Identity``: the block's second LayerNorm is what joins the residual stream, so with
    ``r`` the residual (``r_0 = drop(wte[idx])``, dropout ``embed_dropout``)::

        r = r + mixer_i(norm1_i(r))            LayerNorm(eps)
        r = r + norm2_i(r)                     the Identity state mixer's output, added by the next block
        logits = ln_f(r) wteᵀ

    ``block="mamba2"`` is Zoology's ``Mamba2Block`` (no state mixer, no dropout):
    ``r = r + mixer_i(rms_i(r))`` (RMSNorm(eps)), then ``ln_f``. Backward reverses each line:
    ``dr += norm2'(dr)``, then ``dr += norm1'(mixer'(dr))``. Parameters are named as Zoology's
    modules, ``backbone.layers.{i}.sequence_mixer.{the qkv layer's name}``; no ``config``.
    """

    def __init__(self, vocab_size: int, d_model: int, mixers, *, block: str = "transformer",
                 embed_dropout: float = 0.0, eps: float = 1e-5, dtype=np.float32, rng: np.random.Generator | None = None):
        super().__init__(dtype=dtype, rng=rng)
        from ..nn.layers import Dropout, Embedding
        from ..nn.norms import LayerNorm, RMSNorm

        if block not in ("transformer", "mamba2"):
            raise ShapeError(f"block must be 'transformer' or 'mamba2'; got {block!r}")
        self.block, self.d_model = block, positive_int("d_model", d_model)
        kw = dict(dtype=dtype)
        self.wte = Embedding(positive_int("vocab_size", vocab_size), self.d_model, std=0.02, rng=self.rng, **kw)
        self.drop = Dropout(embed_dropout if block == "transformer" else 0.0, self.rng, **kw)
        self.mixers = list(mixers)
        norm = (lambda: LayerNorm(self.d_model, eps, **kw)) if block == "transformer" else \
            (lambda: RMSNorm(self.d_model, eps, **kw))
        self.norm1 = [norm() for _ in self.mixers]
        self.norm2 = [LayerNorm(self.d_model, eps, **kw) for _ in self.mixers] if block == "transformer" else []
        self.ln_f = LayerNorm(self.d_model, eps, **kw)
        links = {"backbone.embeddings.word_embeddings.weight": (self.wte, "W")}
        for i, mixer in enumerate(self.mixers):
            pre = f"backbone.layers.{i}"
            links.update({f"{pre}.{'norm1' if self.norm2 else 'norm'}.{n}": (self.norm1[i], n) for n in self.norm1[i].params})
            links.update({f"{pre}.sequence_mixer.{n}": (mixer, n) for n in mixer.params})
            if self.norm2:
                links.update({f"{pre}.norm2.{n}": (self.norm2[i], n) for n in self.norm2[i].params})
        links.update({f"backbone.ln_f.{n}": (self.ln_f, n) for n in self.ln_f.params})
        self._expose(links)
        self._sublayers.extend([self.drop] + [m for m in self.mixers if not m.params])
        self.no_decay = set()
        # every product of a step on numba's threads (qkv.nn.products): float32 softmax attention
        # (Zoology's short conv before it too) and BaseConv mixers only
        self.one_pool = np.dtype(dtype) == np.float32 and all(
            type(m) is MultiHeadAttention or isinstance(m, BaseConv) or
            (type(m) is ConvAttention and type(m.attn) is MultiHeadAttention) for m in self.mixers)

    def num_params(self) -> int:
        return self.n_params

    def _hidden(self, idx) -> np.ndarray:
        """``ln_f(r)`` ``(B, T, C)`` for ids ``idx (B, T)``."""
        r = self.drop.forward(self.wte.forward(np.asarray(idx)))               # (B, T, C)
        for i, mixer in enumerate(self.mixers):
            r = r + mixer.forward(self.norm1[i].forward(r))
            if self.norm2:
                r = r + self.norm2[i].forward(r)
        h = self.ln_f.forward(r)
        self._keep(dict(h=h, keep=None, dlogits=None))
        return h

    def forward(self, idx) -> np.ndarray:
        """Logits ``(B, T, V)``."""
        with one_pool(self.one_pool and self.dtype == np.float32):
            h = self._hidden(idx)
            return matmul(h.reshape(-1, h.shape[-1]), self.wte.params["W"].T).reshape(h.shape[:-1] + (-1,))  # (B,T,C) @ (C,V)

    def logits_at(self, idx, keep) -> np.ndarray:
        """Logits ``(N, V)`` at the positions where ``keep (B, T)`` is True (row-major order)."""
        with one_pool(self.one_pool and self.dtype == np.float32):
            return matmul(self._hidden(idx)[np.asarray(keep, dtype=bool)], self.wte.params["W"].T)   # (N,C) @ (C,V)

    def loss(self, idx, targets) -> float:
        """Mean cross-entropy at the targets that are not ``-1`` (Zoology's ``ignore_index``)."""
        from ..nn.optim import cross_entropy

        targets = np.asarray(targets)
        keep = targets != -1
        if targets.shape != np.shape(idx) or not keep.any():
            raise ShapeError(f"targets must have idx's shape {np.shape(idx)} and a position that is not -1; "
                             f"got shape {targets.shape}")
        loss, dlogits = cross_entropy(self.logits_at(idx, keep), targets[keep])
        if self._saved is not None:
            self._saved.update(keep=keep, dlogits=dlogits)
        return loss

    def backward(self) -> None:
        """Fill ``grads`` from the last :meth:`loss` (training mode)."""
        with one_pool(self.one_pool and self.dtype == np.float32):
            self._backward()

    def _backward(self) -> None:
        s = self._need_saved()
        if s["dlogits"] is None:
            raise RuntimeError("ZoologyLM.backward needs loss(idx, targets) first, in training mode")
        h, keep, dlogits = s["h"], s["keep"], s["dlogits"]
        dhead = linear_grad(dlogits, h[keep])                                   # (V,N) @ (N,C) -> (V,C)
        dh = np.zeros_like(h)
        dh[keep] = matmul(dlogits, self.wte.params["W"])                        # (N,V) @ (V,C) -> (N,C)
        dr = self.ln_f.backward(dh)
        for i in reversed(range(len(self.mixers))):
            if self.norm2:
                dr = dr + self.norm2[i].backward(dr)
            dr = dr + self.norm1[i].backward(self.mixers[i].backward(dr))
        self.wte.backward(self.drop.backward(dr))
        self.wte.grads["W"] += dhead                                            # tied: embedding + head
