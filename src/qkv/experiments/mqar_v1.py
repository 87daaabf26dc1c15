"""The table of an ``mqar.json`` recorded before issue 53 (one run a model, no sweep or seeds):
the records kept in docs/ as ``mqar-v1``, ``mqar-avx2``, ``mqar-w64``, ``mqar-700``, ``mqar-plain``."""
from __future__ import annotations


def _grid(rec: dict) -> tuple[list, list, list, dict]:
    """The mixers, widths and pair counts in the record's order, and ``{(mixer, width, pairs): accuracy}``."""
    acc = {(r["mixer"], r["width"], r["pairs"]): r["accuracy"] for r in rec["rows"]}
    order = lambda i: list(dict.fromkeys(k[i] for k in acc))  # noqa: E731
    return order(0), order(1), order(2), acc


def format_table_v1(rec: dict) -> str:
    """The record as Markdown: one row per (mixer, width), one column per pair count."""
    mixers, widths, pairs, acc = _grid(rec)
    c = rec["config"]
    tasks = ", ".join(f"{p} at {t}" for p, t in rec.get("tasks", [])) or f"T = {c['seq_len']}"
    conv = c.get("attention_conv", 0)            # records made before the option: plain attention
    attention = f"attention after a short convolution of {conv}" if conv else "plain attention"
    lines = [f"accuracy at the query positions, T = {c['seq_len']} (chance {rec['chance']:.4f}); 2 layers, "
             f"{c['n_head']} head(s), {attention}, {c.get('positions', 'learned')} positions, "
             f"vocabulary {c['vocab_size']}, "
             f"batches of {c['batch']} sequences (pairs at T: {tasks}), warm-up {c['warmup']} steps then cosine"
             + (f"; a model stops once solved (mean loss of a cycle of tasks < {c['stop_loss']:g})"
                if c.get("stop_loss") else ""), "",
             "| mixer | width | steps | lr | " + " | ".join(f"{p} pairs" for p in pairs) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(pairs)]
    run = {(r["mixer"], r["width"]): r for r in rec.get("runs", [])}
    for m in mixers:
        for w in widths:
            r = run.get((m, w), {})                 # records made before per-mixer steps: the config's
            cells = [f"{acc[(m, w, p)]:.3f}" if (m, w, p) in acc else "-" for p in pairs]
            lines.append(f"| {m} | {w} | {r.get('steps', c['steps'])} | {r.get('lr', c['lr']):g} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)
