"""qkv's BERT encoder against sentence-transformers on the CPU, in the same run.

Workloads (all-MiniLM-L6-v2: 6 layers, 12 heads, d = 384, d_ff = 1536):
- ``short``: 256 short sentences (about 10-20 tokens), batch 32, max_seq_length 256;
- ``long``: 16 texts of exactly 512 tokens, batch 16, max_seq_length 512 on both sides.

FLOPs of one forward, per layer, for a batch of B texts of T tokens::

    projections  2·B·T·(4·d² + 2·d·d_ff)     (Q, K, V, O and the two feed-forward matrices)
    attention    4·B·T²·d                    (q kᵀ and P v over all heads)

Each side is timed ``repeats`` times after one warm-up, the two sides alternating (the
suite's one loop, ``timing.alternate``, without re-warming: every call here is a whole
batch of texts); the table shows medians and the ratio sentence-transformers / qkv (> 1:
qkv is faster), of the wall-clock time and of the CPU time (all threads; steadier on a
shared machine). ``qkv bench --suite encoder`` runs it.
"""
from __future__ import annotations

import os

from .timing import alternate

WORDS = ("the quick brown fox jumps over a lazy dog while seven tired animals cross busy streets "
         "because attention weights every token against every other token in the sequence").split()


def short_sentences(n: int = 256) -> list[str]:
    """n deterministic sentences of 6 to 17 words."""
    return [" ".join(WORDS[(7 * i + j) % len(WORDS)] for j in range(6 + i % 12)).capitalize() + "."
            for i in range(n)]


def long_texts(model, n: int = 16, tokens: int = 512) -> list[str]:
    """n texts that tokenize to at least ``tokens`` tokens (each one word per token here)."""
    texts = []
    for i in range(n):
        words = [WORDS[(3 * i + 5 * j) % len(WORDS)] for j in range(tokens + 8)]
        texts.append(" ".join(words))
    lens = [len(e.ids) for e in model.tokenize(texts, max_length=model.config.max_position_embeddings)]
    assert min(lens) == tokens, lens
    return texts


def flops(model, batch_tokens: list[int]) -> float:
    c = model.config
    d, f = c.hidden_size, c.intermediate_size
    return c.num_hidden_layers * sum(2 * t * (4 * d * d + 2 * d * f) + 4 * t * t * d for t in batch_tokens)


def measure(repeats: int = 5, n_short: int = 256, n_long: int = 16) -> list[dict]:
    """One row per workload: sizes, GFLOP, median seconds of each side, their ratio, max error.

    The entry point of ``qkv bench --suite encoder``; needs
    sentence-transformers and torch (the ``test`` extra) besides qkv[models].
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")          # the model is a local folder
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from qkv.models import default_model_path, load_bert

    path = str(default_model_path())
    ours = load_bert(path)
    ref = SentenceTransformer(path, device="cpu")
    rows = []
    for name, texts, batch, max_len in (("short", short_sentences(n_short), 32, 256),
                                         ("long", long_texts(ours, n_long), 16, 512)):
        ours.max_seq_length = max_len
        ref.max_seq_length = max_len
        lens = [len(e.ids) for e in ours.tokenize(texts)]
        last = {}  # each side's latest embeddings: the error is of what was timed

        def side(name, model, texts=texts, batch=batch):
            return lambda: last.__setitem__(name, model.encode(texts, batch_size=batch))
        with torch.inference_mode():
            med = alternate({"qkv": side("qkv", ours), "st": side("st", ref)}, repeats, rewarm_below=0)
        (t_ours, cpu_ours), (t_ref, cpu_ref) = ((med[s]["wall"], med[s]["cpu"]) for s in ("qkv", "st"))
        err = float(np.abs(last["qkv"] - last["st"]).max())
        gf = flops(ours, lens) / 1e9
        rows.append({"workload": name, "texts": len(texts), "tokens": int(sum(lens)), "max_len": max_len,
                     "gflop": gf, "qkv_s": t_ours, "st_s": t_ref, "ratio": t_ref / t_ours,
                     "qkv_cpu_s": cpu_ours, "st_cpu_s": cpu_ref, "cpu_ratio": cpu_ref / cpu_ours,
                     "qkv_gflops": gf / t_ours, "st_gflops": gf / t_ref, "max_abs_err": err})
    return rows
