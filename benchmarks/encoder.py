"""qkv's BERT encoder against sentence-transformers on the CPU, in the same run.

Workloads (all-MiniLM-L6-v2: 6 layers, 12 heads, d = 384, d_ff = 1536):
- ``short``: 256 short sentences (about 10-20 tokens), batch 32, max_seq_length 256;
- ``long``: 16 texts of exactly 512 tokens, batch 16, max_seq_length 512 on both sides.

FLOPs of one forward, per layer, for a batch of B texts of T tokens::

    projections  2·B·T·(4·d² + 2·d·d_ff)     (Q, K, V, O and the two feed-forward matrices)
    attention    4·B·T²·d                    (q kᵀ and P v over all heads)

Each side is timed ``--repeats`` times after one warm-up, the two sides alternating; the
table shows medians and the ratio sentence-transformers / qkv (> 1: qkv is faster), of the
wall-clock time and of the CPU time (all threads; steadier on a shared machine).

    python benchmarks/encoder.py [--repeats 5] [--json FILE]

``qkv bench --suite encoder`` runs the same (``measure(repeats) -> rows``, ``report(...)``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

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


def timed_pair(fn_a, fn_b, repeats: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """``((wall, cpu) of a, (wall, cpu) of b)``: medians of ``repeats`` runs each, alternating
    a, b, a, b after one warm-up each, so that a change in machine load falls on both alike.

    cpu is the process's CPU seconds (all threads): on a shared machine it says how much
    work each side did even when other jobs stretch the wall-clock times.
    """
    fn_a()
    fn_b()
    times = ([], [])
    for _ in range(repeats):
        for fn, out in ((fn_a, times[0]), (fn_b, times[1])):
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            out.append((time.perf_counter() - w0, time.process_time() - c0))
    return tuple((statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for t in times)


def measure(repeats: int = 5, n_short: int = 256, n_long: int = 16) -> list[dict]:
    """One row per workload: sizes, GFLOP, median seconds of each side, their ratio, max error.

    The entry point for ``qkv bench`` (as ``qkv_benchmarks.encoder.measure``); needs
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
        with torch.inference_mode():
            (t_ours, cpu_ours), (t_ref, cpu_ref) = timed_pair(
                lambda: ours.encode(texts, batch_size=batch), lambda: ref.encode(texts, batch_size=batch), repeats)
        err = float(np.abs(ours.encode(texts, batch_size=batch) - ref.encode(texts, batch_size=batch)).max())
        gf = flops(ours, lens) / 1e9
        rows.append({"workload": name, "texts": len(texts), "tokens": int(sum(lens)), "max_len": max_len,
                     "gflop": gf, "qkv_s": t_ours, "st_s": t_ref, "ratio": t_ref / t_ours,
                     "qkv_cpu_s": cpu_ours, "st_cpu_s": cpu_ref, "cpu_ratio": cpu_ref / cpu_ours,
                     "qkv_gflops": gf / t_ours, "st_gflops": gf / t_ref, "max_abs_err": err})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per side (median reported)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    import torch

    rows = measure(args.repeats)
    print(report(rows, args.repeats, torch.get_num_threads()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


def report(rows: list[dict], repeats: int, torch_threads: int) -> str:
    """The rows of :func:`measure` as a text table."""
    lines = [f"encoder benchmark (all-MiniLM-L6-v2), CPU, {os.cpu_count()} cores, torch threads "
             f"{torch_threads}, medians of {repeats}; ratio = sentence-transformers time / qkv time"]
    lines.append(f"{'workload':<8} {'texts':>5} {'tokens':>6} {'GFLOP':>6} {'qkv s':>7} {'s-t s':>7} "
                 f"{'qkv GF/s':>8} {'s-t GF/s':>8} {'ratio s-t/qkv':>13} {'cpu ratio':>9} {'max err':>8}")
    for r in rows:
        lines.append(f"{r['workload']:<8} {r['texts']:>5} {r['tokens']:>6} {r['gflop']:>6.1f} "
                     f"{r['qkv_s']:>7.3f} {r['st_s']:>7.3f} {r['qkv_gflops']:>8.1f} {r['st_gflops']:>8.1f} "
                     f"{r['ratio']:>13.2f} {r['cpu_ratio']:>9.2f} {r['max_abs_err']:>8.1e}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
