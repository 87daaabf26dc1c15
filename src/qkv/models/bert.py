"""A BERT-family encoder on qkv's attention: embeddings, N post-LayerNorm layers, mean pooling.

One layer, on ``x (B, T, d)`` with ``d = H · Dh`` and ``L = kv_lengths`` real tokens per row::

    q, k, v = split(x W_Q + b_Q), split(x W_K + b_K), split(x W_V + b_V)   (B, H, T, Dh) each
    a       = attention(q, k, v, kv_lengths=L)        softmax(q kᵀ / √Dh) v, padding never read
    x       = LayerNorm(x + merge(a) W_O + b_O)       (B, H, T, Dh) -> (B, T, d)
    x       = LayerNorm(x + gelu(x W_1 + b_1) W_2 + b_2)

The first three lines are one :class:`qkv.nn.MultiHeadAttention` (``bias=True``) holding
the checkpoint's arrays; the rest (embeddings, LayerNorm, GELU, feed-forward) is here.
The embeddings are ``word[ids] + position[offset + t] + type[type_ids]``, then a
LayerNorm. A sentence embedding pools the last layer over the real tokens as the folder's
sentence-transformers modules say (all-MiniLM-L6-v2: mean, then L2-normalised).

Speed: everything is float32; ``encode`` sorts texts by length (little padding), pads each
batch only to its own longest text, and runs the batches on one thread per core, with BLAS
and the tiled attention kernel held to one thread each meanwhile (NumPy releases the GIL
in BLAS and ufuncs, so the elementwise passes, which a single BLAS call cannot spread, run
in parallel too). The feed-forward runs in row blocks through one reused hidden buffer.
"""
from __future__ import annotations

import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..errors import ShapeError, positive_int
from ..threads import blas_one_thread, kernel_threads
from ..nn import MultiHeadAttention
from ..io.checkpoint import BertConfig, CheckpointError, SentenceConfig
from .functional import add_layer_norm, bias_act, layer_norm

FFN_ROWS = 512  # rows of the feed-forward per block: OpenBLAS 99 GFLOP/s a core against 96 at 256 (MiniLM)

class Bert:
    """A loaded BERT-family encoder: ``encode`` for sentence embeddings, ``attentions`` to look inside.

    Build one with :func:`load_bert`. ``params`` holds every checkpoint tensor under our
    names (see :func:`qkv.io.checkpoint.name_table`), ``config`` the model's shape,
    ``max_seq_length`` the truncation length of :meth:`encode` (tokens, specials included),
    ``sentence`` how :meth:`encode` pools (from the folder's sentence-transformers modules),
    ``name`` the model as the user named it (a hub id, a folder's name, all-MiniLM-L6-v2).
    """

    def __init__(self, config: BertConfig, params: dict, tokenizer, *, max_seq_length: int,
                 path: Path | None = None, sentence: SentenceConfig | None = None, name: str | None = None):
        self.config = config
        self.name = name or (path.name if path is not None else "bert")  # what the user called it
        self.sentence = sentence or SentenceConfig()
        self.params = params
        self.tokenizer = tokenizer
        self._tokenizer_lock = threading.Lock()  # truncation is tokenizer state: one caller at a time
        self.max_seq_length = int(max_seq_length)
        self.path = path
        self.pad_id = int(config.pad_token_id)
        # The attention blocks are qkv.nn.MultiHeadAttention layers holding the checkpoint's
        # arrays (the same objects as in params: no copy).
        self.attention_layers = []
        for i in range(config.num_hidden_layers):
            layer = MultiHeadAttention(config.hidden_size, config.num_attention_heads, bias=True,
                                       dtype=np.float32, rng=np.random.default_rng(0))
            layer.eval()  # inference only: a forward keeps nothing for backward
            for name, value in layer.params.items():
                ours = params[f"layers.{i}.attn.{name}"]
                if ours.shape != value.shape:
                    raise CheckpointError(f"layers.{i}.attn.{name} must have shape {value.shape} for "
                                          f"MultiHeadAttention; got {ours.shape}")
                layer.params[name] = ours
            self.attention_layers.append(layer)

    def __repr__(self) -> str:
        c = self.config
        return (f"Bert(layers={c.num_hidden_layers}, heads={c.num_attention_heads}, d={c.hidden_size}, "
                f"max_seq_length={self.max_seq_length}, path={str(self.path)!r})")

    # --- tokens ----------------------------------------------------------------------
    def tokenize(self, texts: list[str], max_length: int | None = None):
        """Token ids, type ids and tokens of each text, truncated to ``max_length`` tokens
        (specials included; default ``max_seq_length``). Returns a list of tokenizers' Encodings."""
        max_length = self.max_seq_length if max_length is None else int(max_length)
        if not 2 <= max_length <= self.config.max_position_embeddings:
            raise ShapeError(f"max_length must lie in [2, {self.config.max_position_embeddings}] "
                             f"(the model's position embeddings); got {max_length}")
        with self._tokenizer_lock:
            self.tokenizer.no_padding()
            self.tokenizer.enable_truncation(max_length=max_length)
            return self.tokenizer.encode_batch(list(texts))

    # --- the network -----------------------------------------------------------------
    def forward(self, ids: np.ndarray, lengths: np.ndarray, type_ids: np.ndarray | None = None,
                *, return_attentions: bool = False):
        """Last hidden state ``(B, T, d)`` float32 of padded ``ids (B, T)`` with ``lengths (B,)``.

        With ``return_attentions`` also a list of per-layer weights ``(B, H, T, T)``.
        Rows past ``lengths[b]`` are padding: no token reads them; their own outputs are
        finite but meaningless. BLAS runs on one thread meanwhile (see :mod:`qkv.threads`).
        """
        with blas_one_thread():
            return self._forward(ids, lengths, type_ids, return_attentions)

    def _forward(self, ids, lengths, type_ids, return_attentions: bool):
        cfg, p = self.config, self.params
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise ShapeError(f"ids must be an int array (B, T); got {ids.dtype} {ids.shape}")
        b, t = ids.shape
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.shape != (b,):
            raise ShapeError(f"lengths must have shape (B,) = ({b},); got {lengths.shape}")
        if b and (lengths.min() < 0 or lengths.max() > t):
            raise ShapeError(f"lengths must lie in [0, T] = [0, {t}]; got {lengths.min()}..{lengths.max()}")
        if t > cfg.max_position_embeddings - cfg.position_offset:
            raise ShapeError(f"ids must have at most {cfg.max_position_embeddings - cfg.position_offset} "
                             f"tokens (the model's position embeddings); got T = {t}")
        if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
            raise ShapeError(f"ids must lie in [0, {cfg.vocab_size}); got {ids.min()}..{ids.max()}")
        if type_ids is not None:
            type_ids = np.asarray(type_ids)
            if type_ids.shape != ids.shape or type_ids.dtype.kind not in "iu":
                raise ShapeError(f"type_ids must be an int array of ids' shape (B, T) = ({b}, {t}); "
                                 f"got {type_ids.dtype} {type_ids.shape}")
            if type_ids.size and (type_ids.min() < 0 or type_ids.max() >= cfg.type_vocab_size):
                raise ShapeError(f"type_ids must lie in [0, {cfg.type_vocab_size}); "
                                 f"got {type_ids.min()}..{type_ids.max()}")
        pos = np.arange(cfg.position_offset, cfg.position_offset + t)
        x = p["embed.word"][ids]                              # (B, T, d)
        x += p["embed.position"][pos]                         # (T, d) broadcast over B
        x += p["embed.type"][0] if type_ids is None else p["embed.type"][type_ids]
        x = layer_norm(x, p["embed.ln.gamma"], p["embed.ln.beta"], cfg.layer_norm_eps)
        kv_lengths = lengths if lengths.min(initial=t) < t else None  # no padding: nothing to hide
        weights = []
        for i in range(cfg.num_hidden_layers):
            a, w = self._attention(i, x, kv_lengths, return_attentions)
            weights.append(w)
            x = add_layer_norm(x, a, p[f"layers.{i}.ln1.gamma"], p[f"layers.{i}.ln1.beta"], cfg.layer_norm_eps)
            f = self._feed_forward(i, x)
            x = add_layer_norm(x, f, p[f"layers.{i}.ln2.gamma"], p[f"layers.{i}.ln2.beta"], cfg.layer_norm_eps)
        return (x, weights) if return_attentions else x

    def _attention(self, i: int, x: np.ndarray, kv_lengths, want_weights: bool):
        """Self-attention block of layer i on x (B, T, d): ``(merge(a) W_O + b_O, weights or None)``."""
        res = self.attention_layers[i].forward(x, kv_lengths=kv_lengths, return_weights=want_weights)
        return res if want_weights else (res, None)       # (B, T, d), (B, H, T, T)

    def _feed_forward(self, i: int, x: np.ndarray) -> np.ndarray:
        """``gelu(x W_1 + b_1) W_2 + b_2`` on x (B, T, d), FFN_ROWS rows at a time."""
        p = self.params
        w1, b1 = p[f"layers.{i}.ffn.W_1"], p[f"layers.{i}.ffn.b_1"]
        w2, b2 = p[f"layers.{i}.ffn.W_2"], p[f"layers.{i}.ffn.b_2"]
        rows = x.reshape(-1, x.shape[-1])
        out = np.empty_like(rows)
        hid = np.empty((min(FFN_ROWS, rows.shape[0]), w1.shape[1]), dtype=rows.dtype)  # reused
        for r0 in range(0, rows.shape[0], FFN_ROWS):
            blk = rows[r0:r0 + FFN_ROWS]
            h = hid[:blk.shape[0]]
            np.matmul(blk, w1, out=h)                         # (rows, d) @ (d, d_ff) -> (rows, d_ff)
            bias_act(h, b1, self.config.hidden_act)           # act(h + b_1), in place
            np.matmul(h, w2, out=out[r0:r0 + FFN_ROWS])       # (rows, d_ff) @ (d_ff, d) -> (rows, d)
        out += b2
        return out.reshape(x.shape)

    # --- public jobs -----------------------------------------------------------------
    def encode(self, texts, batch_size: int = 32, *, threads: int | None = None) -> np.ndarray:
        """Sentence embeddings ``(N, d)`` float32: mean over real tokens, L2-normalised.

        The same numbers as sentence-transformers' ``encode`` of the same folder: truncation
        to ``max_seq_length`` tokens (specials included), then the pooling (mean, cls or max)
        and normalisation its modules.json asks for (mean and L2 without one). ``texts`` is a
        list of strings (a single string counts as a list of one). ``threads`` (default: the
        CPU count) is how many batches run at once; while they run, BLAS is held to one
        thread (restored afterwards) and the tiled attention kernel called from them uses one
        thread (:func:`qkv.threads.kernel_threads`; the process-wide ``qkv.set_num_threads``
        is left alone).
        """
        if isinstance(texts, str):
            texts = [texts]
        try:
            texts = list(texts)
        except TypeError:
            raise ShapeError(f"texts must be a string or a list of strings; got {type(texts).__name__}") from None
        for n, s in enumerate(texts):
            if not isinstance(s, str):
                raise ShapeError(f"texts must be strings; texts[{n}] is {type(s).__name__}")
        positive_int("batch_size", batch_size)
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ShapeError(f"threads must be an int >= 1 (or None for the CPU count); got {threads!r}")
        if self.sentence.unsupported:
            raise CheckpointError(f"{self.path}: encode runs Transformer, Pooling (mean, cls or max) and "
                                  f"Normalize modules; this folder also has {self.sentence.unsupported}")
        d = self.config.hidden_size
        if not texts:
            return np.zeros((0, d), np.float32)
        enc = self.tokenize([s.lower() for s in texts] if self.sentence.lowercase else texts)
        order = np.argsort([-len(e.ids) for e in enc], kind="stable")  # longest first
        threads = threads or os.cpu_count() or 1
        # Units of work: batches of at most batch_size, and at least one per thread.
        size = max(1, min(batch_size, -(-len(texts) // threads)))
        units = [order[s:s + size] for s in range(0, len(texts), size)]
        out = np.empty((len(texts), d), np.float32)

        def run(unit, kernel=None):
            ids, types, lengths = self._pad([enc[j] for j in unit])
            with kernel_threads(kernel):
                out[unit] = self._pool(self._forward(ids, lengths, types, False), lengths)

        with blas_one_thread():
            if threads == 1 or len(units) == 1:
                for u in units:
                    run(u)
                return out
            # Our threads bring the parallelism: the tiled attention kernel called from each
            # of them gets one thread (for these calls only), so that no more threads than
            # cores compete.
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda u: run(u, kernel=1), units))
        return out

    def _pool(self, hidden: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Sentence vectors ``(B, d)`` from ``hidden (B, T, d)`` over the first ``lengths[b]`` tokens."""
        real = np.arange(hidden.shape[1]) < lengths[:, None]                  # (B, T)
        mode = self.sentence.pooling
        if mode == "cls":
            pooled = hidden[:, 0]
        elif mode == "max":
            pooled = np.where(real[..., None], hidden, -np.inf).max(axis=1)
        else:  # mean over real tokens: (B, T) @ (B, T, d) -> (B, d)
            pooled = np.einsum("bt,btd->bd", real.astype(hidden.dtype), hidden)
            pooled /= np.maximum(lengths, 1)[:, None].astype(hidden.dtype)
        if self.sentence.normalize:
            norm = np.sqrt(np.einsum("bd,bd->b", pooled, pooled))[:, None]    # (B, 1)
            pooled = pooled / np.maximum(norm, 1e-12)
        return pooled.astype(np.float32, copy=False)

    def attentions(self, text: str, max_length: int | None = None):
        """``(tokens, weights (layers, heads, T, T))`` for one text, specials included.

        Truncates to ``max_length`` tokens (default: the model's position embeddings, 512
        for BERT), with a UserWarning when it does.
        """
        if not isinstance(text, str):
            raise ShapeError(f"text must be a string; got {type(text).__name__}")
        cfg = self.config
        limit = cfg.max_position_embeddings - cfg.position_offset if max_length is None else max_length
        (e,) = self.tokenize([text], limit)
        if e.overflowing:
            warnings.warn(f"the text has more than {limit} tokens; only the first {limit} are used",
                          UserWarning, stacklevel=2)
        ids, types, lengths = self._pad([e])
        _, weights = self.forward(ids, lengths, types, return_attentions=True)
        return list(e.tokens), np.stack([w[0] for w in weights]).astype(np.float32, copy=False)

    def _pad(self, encodings):
        """``ids (B, T)``, ``type_ids (B, T)``, ``lengths (B,)``, padded with pad_id to the longest."""
        lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
        t = int(lengths.max())
        ids = np.full((len(encodings), t), self.pad_id, dtype=np.int64)
        types = np.zeros((len(encodings), t), dtype=np.int64)
        for r, e in enumerate(encodings):
            ids[r, :lengths[r]] = e.ids
            types[r, :lengths[r]] = e.type_ids
        return ids, types, lengths
