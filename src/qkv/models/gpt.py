"""A GPT in NumPy that trains: nanoGPT's ``model.py`` on :mod:`qkv.nn`, backward beside forward.

The model, on token ids ``idx (B, T)`` (GPT-2's architecture; ``C = n_embd``, ``V = vocab_size``)::

    x = wte[idx] + wpe[0..T-1]              (B, T, C)   learned positions (or RoPE in attention)
    x = drop(x)
    x = block(x)  for each of n_layer        (B, T, C)   pre-norm: x + mixer(ln_1(x)), x + mlp(ln_2(x))
    x = ln_f(x)
    logits = x @ wteᵀ                        (B, T, C) @ (C, V) -> (B, T, V)   head tied to wte
    loss = mean(-log softmax(logits)[targets])

Backward runs it in reverse (:meth:`GPT.backward`), from the ``dlogits`` that the loss kept:
``dwte_head = dlogitsᵀ x``, ``dx = dlogits @ wte``, then ``ln_f``, the blocks in reverse,
the dropout, and the embeddings (rows used more than once add up; the tied ``wte`` gets its
embedding and its head gradient summed).

Parameter names follow nanoGPT's and Hugging Face's module paths, with each qkv layer's own
names at the leaves, in qkv's layout (``x @ W``: a ``W`` is ``(in, out)``)::

    transformer.wte.weight           (V, C)          token embedding = LM head (tied)
    transformer.wpe.weight           (block_size, C) positions="learned" only
    transformer.h.{i}.ln_1.weight    (C,)            .ln_1.bias (C,) with bias=True
    transformer.h.{i}.attn.W_Q       (C, n_head·hs)  W_K, W_V (C, n_kv_head·hs), W_O (n_head·hs, C); b_Q ...
    transformer.h.{i}.ln_2.weight    (C,)            .ln_2.bias
    transformer.h.{i}.mlp.W_fc       (C, 4C)         W_proj (4C, C); b_fc, b_proj
    transformer.ln_f.weight          (C,)            .ln_f.bias
    lm_head.weight                   (V, C)          tie_weights=False only

Each block's mixer is softmax attention unless ``GPTConfig.layers`` names others (Mamba-2,
Gated DeltaNet, RG-LRU, linear attention; patterns ``jamba``, ``qwen3-next``, ``griffin``):
see :mod:`qkv.models.hybrid`. A recurrent mixer's parameters are ``transformer.h.{i}.mixer.*``;
``attention:conv=K`` adds ``transformer.h.{i}.attn.short_conv.*`` (W_proj, b_proj, conv_weight, conv_bias).

Initialisation as nanoGPT: every matrix normal(0, 0.02), the residual projections
(``attn.W_O``, ``mlp.W_proj``, a mixer's ``W_out``) normal(0, 0.02 / sqrt(2 n_layer)), biases 0,
norms 1 (a recurrent mixer's input projections as the matrices, its other arrays as the layer
initialises them: convolution taps, gates, decays); drawn
in float64 from ``seed`` and cast, so a float32 and a float64 model of one seed agree.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..errors import ShapeError, fmt_shape, positive_int
from ..nn import Dropout, Embedding, LayerNorm, MLP, MultiHeadAttention, TransformerBlock
from ..nn.base import Layer, linear_grad
from ..nn.optim import cross_entropy
from ..nn.products import matmul, one_pool
from . import hybrid
from .gpt_cache import GPTCache

SAVED_FORMAT = "qkv-gpt"  # config.json's "format" in a folder GPT.save wrote
POSITIONS = ("learned", "rope")
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")


def _in_pool(method):
    """``method`` inside :func:`qkv.nn.products.one_pool` where the model's ``one_pool`` says so
    and its weights are float32 still (a model cast to float64 later runs NumPy's products)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with one_pool(self.one_pool and self.dtype == np.float32):
            return method(self, *args, **kwargs)
    return run


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a :class:`GPT` (nanoGPT's GPTConfig, plus qkv's options).

    ``n_kv_head``: key/value heads (GQA; None = ``n_head``). ``positions``: ``"learned"``
    (GPT-2's ``wpe``) or ``"rope"`` (rotary, in the attention). ``activation``: the MLP's,
    ``"gelu_tanh"`` (GPT-2's), ``"gelu"`` or ``"swiglu"``. ``n_inner``: MLP width (None =
    ``4 n_embd``). ``dropout``: nanoGPT's, in ``train()`` mode only: on the embeddings'
    sum, on each block's two branches, and on the attention weights (qkv's ``dropout_p``,
    its keep-mask seeded per call from the model's generator). ``dtype``: float32, float64
    for checks, or float16 for inference only (:class:`qkv.nn.AdamW` refuses to train it:
    train in float32 and cast). ``seed``: the initial weights and the dropout masks.
    ``layers``: each block's mixer (:mod:`qkv.models.hybrid`): None (softmax attention in
    every block, as GPT-2), a pattern (``"jamba"``, ``"qwen3-next"``, ``"griffin"``) or a list
    (or comma-separated string) of ``"attention"``, ``"attention:window=W"``,
    ``"attention:chunk=N"``, ``"attention:conv=K"`` (Zoology's short convolution before the
    attention; options join: ``"attention:window=W:conv=K"``), ``"mamba2"``, ``"gated_delta"``,
    ``"rglru"``, ``"linear"``.
    """

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    n_kv_head: int | None = None
    dropout: float = 0.0
    bias: bool = True
    positions: str = "learned"
    activation: str = "gelu_tanh"
    tie_weights: bool = True
    dtype: object = np.float32
    seed: int = 0
    n_inner: int | None = None
    layer_norm_eps: float = 1e-5
    rope_base: float = 10000.0
    layers: object = None

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            positive_int(name, getattr(self, name))
        if self.n_embd % self.n_head:
            raise ShapeError(f"n_embd must be a multiple of n_head; got n_embd = {self.n_embd}, n_head = {self.n_head}")
        if self.n_kv_head is not None and self.n_head % positive_int("n_kv_head", self.n_kv_head):
            raise ShapeError(f"n_head must be a multiple of n_kv_head; got {self.n_head} and {self.n_kv_head}")
        if self.positions not in POSITIONS:
            raise ShapeError(f"positions must be one of {list(POSITIONS)}; got {self.positions!r}")
        if self.activation not in ACTIVATIONS:
            raise ShapeError(f"activation must be one of {list(ACTIVATIONS)}; got {self.activation!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ShapeError(f"dropout must be a probability in [0, 1); got {self.dropout!r}")
        if self.n_inner is not None:
            positive_int("n_inner", self.n_inner)
        positive_int("seed", self.seed, 0)
        try:
            dtype = np.dtype(self.dtype)
        except TypeError:
            dtype = None
        if dtype not in (np.float16, np.float32, np.float64):
            raise ShapeError(f"dtype must be float16, float32 or float64; got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "layers", hybrid.normalise(self.layers))
        hybrid.resolve(self.layers, self.n_layer)  # a pattern n_layer cannot hold fails here

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each block's mixer, ``n_layer`` entries (``"attention"`` for every block when ``layers`` is None)."""
        return hybrid.resolve(self.layers, self.n_layer)

    def to_dict(self) -> dict:
        """The fields as JSON values (the dtype by name)."""
        d = dict(asdict(self), dtype=self.dtype.name)
        if isinstance(self.layers, tuple):
            d["layers"] = list(self.layers)
        return d


class GPT(Layer):
    """A decoder-only transformer (see the module docstring); ``GPT(GPTConfig(...))``.

    ``forward(idx) -> logits``, ``loss(idx, targets) -> float`` (keeps what backward needs),
    ``backward()`` (fills ``grads``), ``params``/``grads`` (flat dicts, names above),
    ``train()``/``eval()``, ``generate(...)`` (KV cache), ``save(dir)``; :func:`load_gpt` reads
    a saved model and :func:`load_gpt2` a Hugging Face GPT-2. ``no_decay`` names the
    embeddings, which :class:`qkv.nn.AdamW` does not decay.

    ``attention`` makes each block's attention layer, called as
    :class:`~qkv.nn.MultiHeadAttention` is (the default); :mod:`qkv.distributed.train` passes
    its ring attention layer (context parallel), which draws the same initial weights.
    ``token_positions`` (None: ``0 .. T-1``) are the global positions ``(T,)`` of the tokens
    ``forward`` gets when they are a rank's shard of a longer sequence; the learned ``wpe``
    is read and its gradient written at them (a ring layer rotates RoPE at them itself).
    """

    def __init__(self, config: GPTConfig, *, attention=None):
        if not isinstance(config, GPTConfig):
            raise ShapeError(f"config must be a GPTConfig; got {type(config).__name__}")
        super().__init__(dtype=config.dtype, rng=np.random.default_rng(config.seed))
        c, kw = config, dict(dtype=config.dtype, rng=self.rng)
        self.config = c
        self.wte = Embedding(c.vocab_size, c.n_embd, **kw)
        self.wpe = Embedding(c.block_size, c.n_embd, **kw) if c.positions == "learned" else None
        self.drop = Dropout(c.dropout, self.rng, dtype=c.dtype)
        attention = MultiHeadAttention if attention is None else attention
        self.token_positions = None
        self.h = [TransformerBlock(
            c.n_embd, hybrid.make_mixer(kind, c, self.rng, attention),
            MLP(c.n_embd, c.n_inner, c.activation, c.bias, **kw), "layernorm", c.dropout,
            bias=c.bias, eps=c.layer_norm_eps, **kw) for kind in c.layer_kinds]
        self.stateful = any(block.stateful for block in self.h)  # a block decodes through a state
        # every product of a step on numba's threads (qkv.nn.products): float32 softmax attention blocks only
        self.one_pool = c.dtype == np.float32 and attention is MultiHeadAttention and \
            all(k.split(":")[0] == "attention" for k in c.layer_kinds)
        self.ln_f = LayerNorm(c.n_embd, c.layer_norm_eps, c.bias, dtype=c.dtype)
        self.lm_head = None if c.tie_weights else Embedding(c.vocab_size, c.n_embd, **kw)
        links = {"transformer.wte.weight": (self.wte, "W")}
        if self.wpe is not None:
            links["transformer.wpe.weight"] = (self.wpe, "W")
        for i, block in enumerate(self.h):
            links.update({f"transformer.h.{i}.{name}": (block, name) for name in block.params})
        links.update({f"transformer.ln_f.{name}": (self.ln_f, name) for name in self.ln_f.params})
        if self.lm_head is not None:
            links["lm_head.weight"] = (self.lm_head, "W")
        self._expose(links)
        self._sublayers.append(self.drop)
        self.no_decay = {"transformer.wte.weight", "transformer.wpe.weight"}
        self._init_weights()

    def _init_weights(self) -> None:
        std_proj = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.params.items():
            if ".mixer." in name:  # a recurrent mixer: its projections only
                leaf = name.rsplit(".", 1)[1]
                if leaf in hybrid.MIXER_IN or leaf in hybrid.MIXER_OUT:
                    p[...] = self.rng.standard_normal(p.shape) * (std_proj if leaf in hybrid.MIXER_OUT else 0.02)
            elif ".short_conv.conv_" in name:  # a ConvAttention's taps keep their own init
                continue
            elif p.ndim >= 2:
                std = std_proj if name.endswith(("attn.W_O", "mlp.W_proj")) else 0.02
                p[...] = self.rng.standard_normal(p.shape) * std

    def num_params(self, non_embedding: bool = False) -> int:
        """Scalar parameters (the tied head counted once); ``non_embedding`` leaves out the
        position table (nanoGPT's count)."""
        n = self.n_params
        return n - self.wpe.params["W"].size if non_embedding and self.wpe is not None else n

    def new_cache(self, batch: int, max_len: int) -> GPTCache:
        """A :class:`~qkv.models.gpt_cache.GPTCache` for ``batch`` sequences of up to ``max_len``
        tokens: a list of each block's :class:`qkv.nn.KVCache` (attention) or decoding state
        (a recurrent or linear-attention mixer), with the sequences' lengths."""
        entries = [block.new_cache(batch, max_len) for block in self.h]
        return GPTCache(entries, entries[0].batch, positive_int("max_len", max_len))

    def _head(self) -> np.ndarray:
        return (self.wte if self.lm_head is None else self.lm_head).params["W"]  # (V, C)

    def _ids(self, idx, name: str = "idx") -> np.ndarray:
        idx = np.asarray(idx)
        if idx.ndim != 2 or idx.dtype.kind not in "iu" or idx.shape[1] == 0:
            raise ShapeError(f"{name} must be token ids, an int array (B, T) with T >= 1; "
                             f"got {idx.dtype} {fmt_shape(idx.shape)}")
        return idx

    def _positions(self, t: int, start, counts) -> np.ndarray:
        """``wpe`` rows for this call: ``(T, C)``, or ``(B, T, C)`` after each sequence's ``start``."""
        bs = self.config.block_size
        if start is None:
            pos = self.token_positions
            return self.wpe.params["W"][:t] if pos is None else self.wpe.params["W"][pos]
        ends = start + counts
        if ends.max(initial=0) > bs:
            raise ShapeError(f"a sequence would reach {int(ends.max())} tokens, past block_size = {bs} "
                             "(the learned positions)")
        pos = np.minimum(start[:, None] + np.arange(t), bs - 1)  # padding rows (past counts) clipped
        return self.wpe.params["W"][pos]

    # --- forward / backward --------------------------------------------------------------
    @_in_pool
    def forward(self, idx, *, cache: list | None = None, q_lengths=None) -> np.ndarray:
        """Logits ``(B, T, V)`` of token ids ``idx (B, T)``, ``T <= block_size``.

        With ``cache`` (from :meth:`new_cache`) the tokens follow what each sequence's cache
        holds (``q_lengths (B,)``: only the first ``q_lengths[b]`` of sequence b's rows are
        real, for right-padded prompts); used by :meth:`generate`, inference only. A model with a
        recurrent (or linear-attention) block runs a right-padded batch one sequence at a time
        (a state has no length per sequence): the padding rows' logits are then zeros.
        """
        idx = self._ids(idx)
        b, t = idx.shape
        start = counts = None
        if cache is not None:
            if self.stateful and not isinstance(cache, GPTCache):
                raise ShapeError(f"cache must come from new_cache(batch, max_len) for a model with recurrent or "
                                 f"linear-attention blocks; got a {type(cache).__name__}")
            held = cache if isinstance(cache, GPTCache) else cache[0]   # a list of KV caches made by hand
            start = held.lengths.copy()
            counts = held.counts(t, q_lengths)
            if self.stateful and q_lengths is not None:
                return self._each_alone(idx, cache, counts)
        x = self._hidden(idx, start, counts, cache, q_lengths)     # (B, T, C)
        logits = matmul(x.reshape(b * t, -1), self._head().T)       # (B·T, C) @ (C, V) -> (B·T, V)
        logits = logits.reshape(b, t, -1)                           # (B, T, V)
        if isinstance(cache, GPTCache):
            cache.advance(counts)
        return logits

    def _hidden(self, idx: np.ndarray, start=None, counts=None, cache=None, q_lengths=None) -> np.ndarray:
        """The final LayerNorm's output ``(B, T, C)`` for ids ``idx (B, T)`` (what the head reads)."""
        t = idx.shape[1]
        if cache is None and t > self.config.block_size:
            raise ShapeError(f"idx has T = {t} tokens, more than block_size = {self.config.block_size}")
        x = self.wte.forward(idx)                                   # (B, T) -> (B, T, C)
        if self.wpe is not None:
            x = x + self._positions(t, start, counts)               # + (T, C) or (B, T, C)
        x = self.drop.forward(x)
        for i, block in enumerate(self.h):
            x = block.forward(x, cache=None if cache is None else cache[i], q_lengths=q_lengths)
        x = self.ln_f.forward(x)                                    # (B, T, C)
        self._keep(dict(x=x, t=t, cached=cache is not None, dlogits=None, pos=self.token_positions, keep=None))
        return x

    @_in_pool
    def logits_at(self, idx, keep) -> np.ndarray:
        """Logits ``(N, V)`` at the ``N`` positions where ``keep (B, T)`` (bool) is True, in row-major
        order: ``forward(idx)[keep]`` without the head's product at the other positions (a task
        scored at a few positions of a large vocabulary, as MQAR's queries)."""
        idx = self._ids(idx)
        keep = np.asarray(keep)
        if keep.shape != idx.shape or keep.dtype != bool:
            raise ShapeError(f"keep must be a bool array of idx's shape {fmt_shape(idx.shape)}; "
                             f"got {keep.dtype} {fmt_shape(keep.shape)}")
        return matmul(self._hidden(idx)[keep], self._head().T)      # (N, C) @ (C, V) -> (N, V)

    def _each_alone(self, idx: np.ndarray, cache, counts: np.ndarray) -> np.ndarray:
        """A right-padded batch through a cache with states: each sequence's first ``counts[b]``
        tokens alone, through views of its rows of every block's cache or state."""
        logits = np.zeros(idx.shape + (self._head().shape[0],), self.dtype)   # (B, T, V)
        for row, n in enumerate(counts):
            if n:
                view = cache.row(row)
                logits[row, :n] = self.forward(idx[row:row + 1, :n], cache=view)[0]
                cache.take_row(view, row)
        return logits

    def loss(self, idx, targets) -> float:
        """Mean cross-entropy of ``forward(idx)`` against ``targets (B, T)``; keeps ``dlogits``
        for :meth:`backward` (in training mode). A target of ``-1`` is no target (nanoGPT's
        ``ignore_index=-1``): the mean runs over the other positions, and those get no gradient."""
        targets = np.asarray(targets)
        if targets.dtype.kind in "iu" and targets.shape == np.shape(idx) and (targets == -1).any():
            keep = targets != -1                                    # (B, T)
            if not keep.any():
                raise ShapeError("targets must have at least one position that is not -1 (ignored)")
            loss, dlogits = cross_entropy(self.logits_at(idx, keep), targets[keep])  # (N, V): / N kept positions
            if self._saved is not None:                             # the head's product at the kept rows only
                self._saved["keep"] = keep
        else:
            logits = self.forward(idx)
            loss, dlogits = cross_entropy(logits, targets)          # dlogits = (softmax - onehot) / (B T)
        if self._saved is not None:
            self._saved["dlogits"] = dlogits
        return loss

    @_in_pool
    def backward(self) -> None:
        """Fill ``grads`` with the gradient of the last :meth:`loss` (overwriting them)."""
        s = self._need_saved()
        if s["dlogits"] is None or s["cached"]:
            raise RuntimeError("GPT.backward needs loss(idx, targets) first (in training mode, without cache=)")
        dlogits, x, keep = s["dlogits"], s["x"], s.get("keep")
        if keep is None:
            dhead = linear_grad(dlogits, x)                         # (V, B·T) @ (B·T, C) -> (V, C)
            dx = matmul(dlogits.reshape(-1, dlogits.shape[-1]), self._head()).reshape(x.shape)  # (B·T, V) @ (V, C) -> (B, T, C)
        else:                                                       # dlogits (N, V) at the kept rows
            dhead = linear_grad(dlogits, x[keep])                   # (V, N) @ (N, C) -> (V, C)
            dx = np.zeros_like(x)
            dx[keep] = matmul(dlogits, self._head())                # (N, V) @ (V, C) -> (N, C)
        dx = self.ln_f.backward(dx)
        for block in reversed(self.h):
            dx = block.backward(dx)                                 # (B, T, C)
        dx = self.drop.backward(dx)
        if self.wpe is not None:
            g = self.wpe.grads["W"]
            if s["pos"] is None:
                g[s["t"]:] = 0
                np.sum(dx, axis=0, out=g[:s["t"]])                  # (B, T, C) -> (T, C)
            else:                                                   # distinct global positions
                g[...] = 0
                g[s["pos"]] = dx.sum(axis=0)                        # (B, T, C) -> (T, C) rows
        self.wte.backward(dx)                                       # rows of idx, added up
        if self.lm_head is None:
            self.wte.grads["W"] += dhead                            # tied: embedding + head
        else:
            self.lm_head.grads["W"][...] = dhead

    # --- sampling and files -------------------------------------------------------------
    def generate(self, idx, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                 rng: np.random.Generator | None = None, use_cache: bool = True, return_logits: bool = False):
        """Continue ``idx`` by ``max_new_tokens`` tokens (see :func:`qkv.models.sampling.generate`)."""
        from .sampling import generate

        return generate(self, idx, max_new_tokens, temperature=temperature, top_k=top_k, rng=rng,
                        use_cache=use_cache, return_logits=return_logits)

    def save(self, directory, extra: dict | None = None) -> None:
        """Write ``model.safetensors`` (every array of ``params`` under its name, the tied head
        once) and ``config.json`` (``{"format": "qkv-gpt", "config": {...}, "extra": extra}``)
        into ``directory``; :func:`qkv.models.load_gpt` reads them back."""
        from ..io.tensorfiles import write_tensors

        if extra is not None and not isinstance(extra, dict):
            raise ShapeError(f"extra must be a dict (JSON values) or None; got {type(extra).__name__}")
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {name: np.ascontiguousarray(p) for name, p in self.params.items()}
        write_tensors(tensors, folder / "model.safetensors")
        meta = {"format": SAVED_FORMAT, "config": self.config.to_dict(), "extra": extra or {}}
        (folder / "config.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")

    def __repr__(self) -> str:
        c = self.config
        return (f"GPT(n_layer={c.n_layer}, n_head={c.n_head}, n_embd={c.n_embd}, vocab_size={c.vocab_size}, "
                f"block_size={c.block_size}, positions={c.positions!r}, "
                f"{'' if c.layers is None else f'layers={c.layers!r}, '}{self.num_params()} parameters, {c.dtype})")
