"""The table and the picture of ``qkv experiment mqar`` (the runs: :mod:`qkv.experiments.mqar`)."""
from __future__ import annotations

from ..extras import figure


def _grid(rec: dict) -> tuple[list, list, list, dict]:
    """The mixers, widths and pair counts in the record's order, and ``{(mixer, width, pairs): accuracy}``."""
    acc = {(r["mixer"], r["width"], r["pairs"]): r["accuracy"] for r in rec["rows"]}
    order = lambda i: list(dict.fromkeys(k[i] for k in acc))  # noqa: E731
    return order(0), order(1), order(2), acc


def format_table(rec: dict) -> str:
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


def plot(rec: dict, path) -> None:
    """One panel per pair count: accuracy against width, a line per mixer (hybrids dashed)."""
    mixers, widths, pairs, acc = _grid(rec)
    fig = figure(figsize=(3.2 * len(pairs) + 1.5, 3.6))
    axes = fig.subplots(1, len(pairs), sharey=True, squeeze=False)[0]
    for ax, p in zip(axes, pairs):
        for i, m in enumerate(mixers):
            ws = [w for w in widths if (m, w, p) in acc]
            ax.plot(ws, [acc[(m, w, p)] for w in ws], "o--" if "+" in m else "o-", color=f"C{i}", label=m)
        ax.axhline(1 / p, color="gray", ls=":", lw=1, label="1 / pairs: any value of the context")
        ax.axhline(rec["chance"], color="black", ls=":", lw=1, label="chance: any value")
        ax.set_xscale("log", base=2)
        ax.set_xticks(widths, [str(w) for w in widths])
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{p} pairs")
        ax.set_xlabel("model width (n_embd)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("accuracy at the queries")
    axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    c = rec["config"]
    steps = "steps and lr per mixer" if c["steps"] is None else f"{c['steps']} steps"
    fig.suptitle(f"qkv experiment mqar: 2-layer models, T = {c['seq_len']}, vocabulary {c['vocab_size']}, {steps}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
