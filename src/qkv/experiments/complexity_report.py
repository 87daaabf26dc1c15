"""The table and the picture of ``qkv experiment complexity`` (the measurements:
:mod:`qkv.experiments.complexity`)."""
from __future__ import annotations

import numpy as np

from ..extras import figure
from .complexity import MIB


def _fmt(x, unit: str) -> str:
    return "-" if x is None else f"{x:.3g}{unit}"


def format_table(rec: dict) -> str:
    """The record as Markdown: one row per T, then the slopes, the crossover and decoding."""
    ms = list(rec["methods"])
    lines = ["| T | " + " | ".join(f"{m} fwd / fwd+bwd" for m in ms) + " | " + " | ".join(f"{m} MiB" for m in ms) + " |",
             "|---:|" + "---:|" * (2 * len(ms))]
    for i, t in enumerate(rec["T"]):
        cells = [f"{_fmt(rec['methods'][m]['seconds'][i], ' s')} / {_fmt(rec['methods'][m]['seconds_fwd_bwd'][i], ' s')}"
                 for m in ms]
        cells += [_fmt(rec["methods"][m]["peak_mib_fwd_bwd"][i], "") for m in ms]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    lines.append("")
    sl = rec["slopes"]
    for m in ms:
        parts = [f"{name} {sl[f'{m}_{key}']:.2f}" for name, key in
                 (("time", "time"), ("time fwd+bwd", "time_fwd_bwd"), ("memory", "memory_fwd_bwd"))
                 if sl.get(f"{m}_{key}") is not None]
        why = rec["methods"][m]["stopped"]
        lines.append(f"- {m}: log-log slopes " + (", ".join(parts) or "none") + (f" (stopped: {why})" if why else ""))
    cross = rec["crossover"]
    if cross:
        lines.append(f"- linear attention is faster than the tiled kernel from T = {cross.get('seconds')} "
                     f"(forward) and T = {cross.get('seconds_fwd_bwd')} (forward+backward)")
    dec = rec["decode"]
    if dec["context"]:
        kv, st = dec["kv_cache"], dec["linear_state"]
        lines.append(f"- decoding one token at context {dec['context'][0]} -> {dec['context'][-1]}: KV cache "
                     f"{kv['seconds_per_token'][0] * 1e6:.0f} -> {kv['seconds_per_token'][-1] * 1e6:.0f} us "
                     f"({kv['bytes'][-1] / MIB:.1f} MiB), linear state {st['seconds_per_token'][0] * 1e6:.0f} -> "
                     f"{st['seconds_per_token'][-1] * 1e6:.0f} us ({st['bytes'][-1] / 1024:.0f} KiB)")
    for note in rec["notes"].values():
        lines.append(f"- {note}")
    return "\n".join(lines)


STYLE = {"dense": ("o-", "C3"), "flash": ("s-", "C0"), "chunked": ("^-", "C2"), "linear": ("D-", "C1")}


def plot(rec: dict, path) -> None:
    """Four panels: forward time, forward+backward time, peak memory against T; decoding."""
    fig = figure(figsize=(14, 10))
    axes = fig.subplots(2, 2)
    ts = np.array(rec["T"], dtype=float)
    cfg = rec["config"]
    sec = "CPU seconds" if cfg.get("clock") == "cpu" else "seconds"
    if cfg.get("threads"):
        sec += f" ({cfg['threads']} thread{'s' if cfg['threads'] > 1 else ''})"
    panels = ((axes[0, 0], "seconds", "time", f"forward: {sec}"),
              (axes[0, 1], "seconds_fwd_bwd", "time_fwd_bwd", f"forward + backward: {sec}"),
              (axes[1, 0], "peak_mib_fwd_bwd", "memory_fwd_bwd", "forward + backward: peak traced MiB"))
    for ax, key, slope_key, title in panels:
        for m, r in rec["methods"].items():
            y = np.array([np.nan if x is None else x for x in r[key]], dtype=float)
            if np.all(np.isnan(y)):
                continue
            s = rec["slopes"].get(f"{m}_{slope_key}")
            marker, color = STYLE.get(m, ("o-", None))
            ax.loglog(ts, y, marker, color=color, label=f"{m} (slope {s:.2f})" if s is not None else m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length T (causal, one head, D = 64, float32)")
        ax.set_title(title)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend()
    for ax, key in ((axes[0, 0], "seconds"), (axes[0, 1], "seconds_fwd_bwd")):
        t = rec["crossover"].get(key)
        if t is not None:
            ax.axvline(t, color="gray", ls=":", lw=1)
            text = "linear faster at\nevery T measured" if t == rec["T"][0] else f"linear faster\nfrom T = {t}"
            ax.annotate(text, (t, ax.get_ylim()[1]), ha="left", va="top", fontsize=8)
    ax = axes[1, 1]
    dec = rec["decode"]
    ctx = np.array(dec["context"], dtype=float)
    if len(ctx):
        ax.loglog(ctx, np.array(dec["kv_cache"]["seconds_per_token"]) * 1e6, "s-", color="C0", label="softmax + KV cache: µs/token")
        ax.loglog(ctx, np.array(dec["linear_state"]["seconds_per_token"]) * 1e6, "D-", color="C1", label="linear state: µs/token")
        ax.set_xscale("log", base=2)
        ax2 = ax.twinx()
        ax2.loglog(ctx, np.array(dec["kv_cache"]["bytes"]) / 1024, "s--", color="C0", alpha=0.5, label="KV cache: KiB kept")
        ax2.loglog(ctx, np.array(dec["linear_state"]["bytes"]) / 1024, "D--", color="C1", alpha=0.5, label="linear state: KiB kept")
        ax2.set_ylabel("KiB kept (dashed)")
        ax2.set_xscale("log", base=2)  # the twin shares x: loglog above set it to base 10
        lines = ax.get_legend_handles_labels()
        more = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper left")
    ax.set_xlabel("context length (tokens already seen)")
    ax.set_ylabel("µs per decoded token (solid)")
    ax.set_title("decoding one token: d_model = 64, one head")
    ax.grid(True, which="major", alpha=0.3)
    fig.suptitle("qkv experiment complexity: the cost of the QKᵀ matrix, measured")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
