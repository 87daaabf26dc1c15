"""The table and the picture of ``qkv experiment mqar`` (the runs: :mod:`qkv.experiments.mqar_runs`).

Each cell is over the seeds of the chosen learning rate: the median, and the lowest and highest
(``0.98 (0.97-0.99)``).
"""
from __future__ import annotations

import numpy as np

from ..extras import figure


def cells(rec: dict) -> tuple[list, list, list, dict]:
    """The mixers, widths and pair counts in the record's order, and ``{(mixer, width, pairs):
    [accuracy of each seed at the chosen lr]}``."""
    acc = {}
    for r in rec["rows"]:
        if r.get("chosen", True):
            acc.setdefault((r["mixer"], r["width"], r["pairs"]), []).append(r["accuracy"])
    order = lambda i: list(dict.fromkeys(k[i] for k in acc))  # noqa: E731
    return order(0), order(1), order(2), acc


def _cell(values: list) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{np.median(values):.3f} ({min(values):.2f}-{max(values):.2f})"


def format_table(rec: dict) -> str:
    """The record as Markdown: one row per (mixer, width), one column per pair count (a record
    made before the sweep and seeds: :func:`~qkv.experiments.mqar_v1.format_table_v1`'s table)."""
    if "chosen_lr" not in rec:
        from .mqar_v1 import format_table_v1

        return format_table_v1(rec)
    mixers, widths, pairs, acc = cells(rec)
    c = rec["config"]
    tasks = ", ".join(f"{p} at {t}" for p, t in rec["tasks"])
    steps = {}
    for r in rec["runs"]:
        if r["chosen"]:
            steps.setdefault((r["mixer"], r["width"]), []).append(r["steps"])
    lines = [f"accuracy at the query positions of the test set, T = {c['seq_len']} (chance {rec['chance']:.5f}); "
             f"median (lowest-highest) over seeds {c['seeds']} at the lr chosen on validation from {c['lrs']}; "
             + ("Zoology's models (its blocks without MLP, a BaseConv layer then the mixer, Mamba-2 alone), "
                if c.get("model") == "zoology" else
                f"{'a BaseConv layer of ' + str(c['baseconv']) + ' taps then ' if c['baseconv'] else ''}the mixer, "
                f"{c['n_head']} head(s), ")
             + f"vocabulary {c['vocab_size']} ({c['filler']} filler), batches of {c['batch']} "
             f"(pairs at T: {tasks}), at most {c['steps']} steps, AdamW wd {c['weight_decay']:g}, cosine to 0; a "
             f"run stops at validation accuracy > {c['stop_accuracy']:g}; {rec['machine']}", "",
             "| mixer | width | lr | steps | " + " | ".join(f"{p} pairs" for p in pairs) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(pairs)]
    for m in mixers:
        for w in widths:
            lr = rec["chosen_lr"].get(f"{m}@{w}")
            st = steps.get((m, w), [])
            cells_ = [_cell(acc[(m, w, p)]) if (m, w, p) in acc else "-" for p in pairs]
            lines.append(f"| {m} | {w} | {lr:g} | {'/'.join(map(str, st))} | " + " | ".join(cells_) + " |")
    found = claims(rec)
    if found:
        lines += ["", "Issue 53's claims, read off these rows (`qkv.experiments.mqar_report.claims`):", ""]
        lines += [f"- {c}" for c in found]
    return "\n".join(lines)


def quick_finding(rec: dict) -> str:
    """``--quick``'s one line: attention's accuracy at the smallest pair count against each other mixer's."""
    mixers, widths, pairs, acc = cells(rec)
    p, w = pairs[0], widths[0]
    got = {m: float(np.median(acc[(m, w, p)])) for m in mixers if (m, w, p) in acc}
    att = got.get("attention")
    if att is None:
        return ""
    others = ", ".join(f"{m} {a:.2f}" for m, a in got.items() if m != "attention")
    shown = att >= 0.9 and all(a <= 0.5 for m, a in got.items() if m != "attention")
    return (f"\nat width {w}, {p} pairs: attention {att:.2f}, {others}: "
            + ("attention recalls what the fixed state does not (Zoology's finding)" if shown else
               "the contrast (attention >= 0.9, the others <= 0.5) did not show in this run"))


def plot(rec: dict, path) -> None:
    """One panel per pair count: the median accuracy against width, the seeds' range as bars, a
    line per mixer (hybrids dashed)."""
    mixers, widths, pairs, acc = cells(rec)
    fig = figure(figsize=(3.2 * len(pairs) + 1.8, 3.6))
    axes = fig.subplots(1, len(pairs), sharey=True, squeeze=False)[0]
    for ax, p in zip(axes, pairs):
        for i, m in enumerate(mixers):
            ws = [w for w in widths if (m, w, p) in acc]
            med = np.array([np.median(acc[(m, w, p)]) for w in ws])
            lo = med - [min(acc[(m, w, p)]) for w in ws]
            hi = [max(acc[(m, w, p)]) for w in ws] - med
            ax.errorbar(ws, med, yerr=[lo, hi], fmt="o--" if "+" in m else "o-", color=f"C{i % 10}", label=m,
                        capsize=2, lw=1)
        ax.axhline(1 / p, color="gray", ls=":", lw=1, label="1 / pairs")
        ax.set_xscale("log", base=2)
        ax.set_xticks(widths, [str(w) for w in widths])
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{p} pairs")
        ax.set_xlabel("model width (n_embd)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("test accuracy at the queries")
    axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    c = rec["config"]
    fig.suptitle(f"qkv experiment mqar: T = {c['seq_len']}, vocabulary {c['vocab_size']}, median and range over "
                 f"{len(c['seeds'])} seed(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


SOLVED = 0.95    # issue 53's bar for attention
CHANCE = 0.05    # below it (every seed), a cell is "at chance": a rise or a fall between two such is noise


def _med(acc, key):
    return float(np.median(acc[key])) if key in acc else None


def _seeds(values) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def claims(rec: dict) -> list[str]:
    """Issue 53's item 4, read off the record: one line a claim, ``holds`` or ``fails`` with the
    cells and seeds where it fails. Over the seeds of the chosen lr: attention >= 0.95 at every
    width and pair count (every seed); each recurrence's median rising with width at fixed pairs
    and falling with pairs at fixed width (a step between two cells at chance, every seed under
    0.05, is not counted either way); Gated DeltaNet >= Mamba-2 >= linear attention (medians,
    each width and pair count, the widths equal, not the states); each hybrid ``attention+X`` >=
    X alone (medians)."""
    from .mqar import RECURRENT

    mixers, widths, pairs, acc = cells(rec)
    out = []
    if "attention" in mixers:
        low = [(w, p, acc[("attention", w, p)]) for w in widths for p in pairs
               if ("attention", w, p) in acc and min(acc[("attention", w, p)]) < SOLVED]
        out.append(f"attention >= {SOLVED} at every width and pair count, every seed: " + (
            "holds" if not low else "fails at " + "; ".join(f"width {w}, {p} pairs (seeds {_seeds(v)})"
                                                           for w, p, v in low)))

    def at_chance(*keys):
        return all(k in acc and max(acc[k]) < CHANCE for k in keys)

    for m in [m for m in RECURRENT if m in mixers]:
        bad = []
        for p in pairs:
            for a, b in zip(widths, widths[1:]):
                x, y = (m, a, p), (m, b, p)
                if x in acc and y in acc and not at_chance(x, y) and _med(acc, y) < _med(acc, x):
                    bad.append(f"{p} pairs, width {a} -> {b}: {_med(acc, x):.3f} -> {_med(acc, y):.3f} "
                               f"(seeds {_seeds(acc[x])} -> {_seeds(acc[y])})")
        for w in widths:
            for a, b in zip(pairs, pairs[1:]):
                x, y = (m, w, a), (m, w, b)
                if x in acc and y in acc and not at_chance(x, y) and _med(acc, y) > _med(acc, x):
                    bad.append(f"width {w}, {a} -> {b} pairs: {_med(acc, x):.3f} -> {_med(acc, y):.3f}")
        flat = all(at_chance((m, w, p)) for w in widths for p in pairs if (m, w, p) in acc)
        out.append(f"{m}: rising with width, falling with pairs: " + (
            "at chance in every cell (every seed < 0.05): neither shows" if flat else
            "holds" if not bad else "fails: " + "; ".join(bad)))
    order = [m for m in ("gated_delta", "mamba2", "linear") if m in mixers]
    if len(order) > 1:
        bad = []
        for w in widths:
            for p in pairs:
                meds = [_med(acc, (m, w, p)) for m in order]
                if None not in meds and any(a < b for a, b in zip(meds, meds[1:])) and \
                        not at_chance(*[(m, w, p) for m in order]):
                    bad.append(f"width {w}, {p} pairs: " + ", ".join(f"{m} {v:.3f}" for m, v in zip(order, meds)))
        out.append(" >= ".join(order) + " (medians, equal width): " + ("holds" if not bad else "fails at " +
                                                                       "; ".join(bad)))
    for m in [m for m in RECURRENT if f"attention+{m}" in mixers and m in mixers]:
        h = f"attention+{m}"
        bad = [f"width {w}, {p} pairs: {_med(acc, (h, w, p)):.3f} < {_med(acc, (m, w, p)):.3f}"
               for w in widths for p in pairs
               if (h, w, p) in acc and (m, w, p) in acc and _med(acc, (h, w, p)) < _med(acc, (m, w, p))]
        out.append(f"{h} >= {m} alone (medians): " + ("holds" if not bad else "fails at " + "; ".join(bad)))
    return out
