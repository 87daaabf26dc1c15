"""The tables of ``qkv bench --suite hybrid`` and ``--suite hybrid-decode`` (rows: :mod:`hybrid_suite`)."""
from __future__ import annotations

from .table import Table, fmt

MIB = 2 ** 20


def lm_table(rows: list[dict], threads: int | None = None, smoke: str = "") -> Table:
    """Val loss, ms/step and params per pattern."""
    r0 = rows[0]
    c = r0["config"]
    t = Table(f"layer patterns: nanoGPT's CPU recipe (block {c['block_size']}, batch {c['batch_size']}, width "
              f"{c['n_embd']}, {c['n_head']} heads), {r0['steps']} steps, float32, {threads or '?'} threads{smoke}",
              ["pattern", "layers", "params", "val loss", "train loss", "ms/step", "tokens/s"], left=2)
    for r in rows:
        t.rows.append([r["pattern"], _kinds(r["kinds"]), f"{r['params']:,}", fmt(r["val_loss"], ".4f"),
                       fmt(r["train_loss"], ".4f"), fmt(r["ms_per_step"], ".1f"), fmt(r["tokens_per_s"], ".0f")])
    t.notes.append(f"val loss: mean over {r0['eval_iters']} val batches after the last step (the same batches for "
                   "every pattern); train loss: mean of the last 50 steps; ms/step: median after the warm-up "
                   f"({r0['warmup_steps']} steps); text: {r0['data']}")
    t.notes.append("layers: A attention, M Mamba-2, G Gated DeltaNet, R RG-LRU, W64 attention with window 64")
    return t


def decode_table(rows: list[dict], repeats: int | None = None, threads: int | None = None, smoke: str = "") -> Table:
    """Per size and pattern: tokens/s and cache MiB of one sequence at each context."""
    contexts = sorted({r["context"] for r in rows})
    runs = f", median of {repeats} rounds" if repeats else ""
    t = Table(f"decoding one token, batch 1, random weights, float32, {threads or '?'} threads{runs}{smoke}: "
              "tokens/s · cache MiB per sequence",
              ["model", "pattern", "layers", *(f"L={_k(n)}" for n in contexts), "state MiB",
               f"+ms / attention layer, L={_k(contexts[0])} to {_k(contexts[-1])}"], left=3)
    for key in dict.fromkeys((r["size"], r["pattern"], r["n_layer"]) for r in rows):
        mine = {r["context"]: r for r in rows if (r["size"], r["pattern"], r["n_layer"]) == key}
        r0, last = mine[min(mine)], mine[max(mine)]
        cells = [f"{fmt(mine[n]['tokens_per_s'], '.0f')} · {mine[n]['cache_bytes'] / MIB:.2f}" if n in mine else "—"
                 for n in contexts]
        n_attention = sum(k.startswith("attention") for k in r0["kinds"])
        growth = (last["ms_per_token"] - r0["ms_per_token"]) / n_attention if n_attention else None
        t.rows.append([f"{key[0]} (C={r0['n_embd']}, H={r0['n_head']})", key[1], _kinds(r0["kinds"]), *cells,
                       f"{r0['state_bytes'] / MIB:.3f}", fmt(growth, ".2f")])
    t.notes.append("each cell: tokens/s of GPT.forward(tok (1,1), cache=...), generate's cached step, at context L · "
                   "the bytes of every cache array of the sequence (KV caches allocated for L+1 tokens; a windowed layer's for its last W)")
    t.notes.append("the cache is filled synthetically (random keys, values and states, lengths set to L), not by "
                   "an L-token prefill; state MiB: the recurrent layers' conv windows and states, the same at every L")
    t.notes.append("+ms / attention layer: the step's ms at the longest L less at the shortest, over the attention "
                   "layers: where it matches the all-attention model's, the recurrent layers added nothing as L grew")
    t.notes.append("layers: A attention, M Mamba-2, G Gated DeltaNet, R RG-LRU, W64 attention with window 64")
    return t


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _kinds(kinds: list[str]) -> str:
    """``["mamba2", "attention"]`` -> ``"MA"``: one letter a block."""
    short = {"attention": "A", "mamba2": "M", "gated_delta": "G", "rglru": "R", "linear": "L"}
    return " ".join(short.get(k, "W" + k.rpartition("=")[2] if "window=" in k else k) for k in kinds)
