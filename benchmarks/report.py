"""The tables and the plot of ``qkv bench`` (the measuring is in ``attention.py``)."""
from __future__ import annotations

import sys

from .attention import MIB, METHODS


def console(stderr=False):
    from rich.console import Console
    # A wide console when not a terminal, so piped tables are never wrapped or cut.
    return Console(stderr=stderr, width=None if sys.stdout.isatty() else 200)


def _fmt(x, spec):
    return "—" if x is None else format(x, spec)


def report(results: dict) -> None:
    from rich import box
    from rich.table import Table

    con = console()
    blas = results["blas"]
    con.print(f"qkv bench: {results['threads']} threads, median of {results['repeats']} runs"
              f"{' (quick sizes)' if results['quick'] else ''}; torch {results['torch'] or 'not installed'};"
              f" BLAS {blas.get('library', '?')} {blas.get('version', '')} kernel {blas.get('kernel', '?')}")
    if blas["env"]:
        env = " ".join(f"{k}={v}" for k, v in blas["env"].items())
        con.print(f"note: {env} is set, which pins OpenBLAS to that kernel and can slow NumPy; for the "
                  "machine's own speed run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE qkv bench")
    con.print("FLOP: forward 4·B·H·Tq·Tk·D (causal: half); forward+backward 3.5x forward")

    if results["main"]:
        s = results["main"][0]["shape"]
        t = Table(title=f"attention B={s['b']} H={s['h']} T={s['t']} D={s['d']} float32", box=box.SIMPLE)
        for col in ("case", "qkv s", "dense s", "torch s", "qkv GFLOP/s", "dense GFLOP/s",
                    "torch GFLOP/s", "qkv/torch"):
            t.add_column(col, justify="left" if col == "case" else "right")
        for r in results["main"]:
            sec = r["seconds"]
            gf = {m: r["flop"] / sec[m] / 1e9 if m in sec else None for m in METHODS}
            ratio = sec["torch"] / sec["qkv"] if "torch" in sec else None
            t.add_row(r["case"], *(_fmt(sec.get(m), ".4f") for m in METHODS),
                      *(_fmt(gf[m], ".1f") for m in METHODS), _fmt(ratio, ".2f"))
        con.print(t)
    if results["sweep"]:
        t = Table(title=f"scaling: forward+backward, one head, D={results['sweep'][0]['d']}, float32; "
                        "peak extra memory = RSS high-water in a subprocess", box=box.SIMPLE)
        for col in ("T", "qkv s", "dense s", "torch s", "qkv MiB", "dense MiB", "torch MiB", "qkv/torch"):
            t.add_column(col, justify="right")
        for r in results["sweep"]:
            sec, peak = r["seconds"], r["peak"]
            mib = {m: peak[m]["extra_bytes"] / MIB if peak.get(m) else None for m in METHODS}
            ratio = sec["torch"] / sec["qkv"] if "torch" in sec else None
            t.add_row(str(r["t"]), *(_fmt(sec.get(m), ".4f") for m in METHODS),
                      *(_fmt(mib[m], ".1f") for m in METHODS), _fmt(ratio, ".2f"))
        con.print(t)
    if results["decode"]:
        r = results["decode"][0]
        s = r["shape"]
        t = Table(title=f"decode: Tq=1 Tk={s['tk']} Hq={s['hq']} Hkv={s['hkv']} D={s['d']} float32; "
                        f"GB/s of K and V read ({r['bytes'] / MIB:.0f} MiB a call)", box=box.SIMPLE)
        for col in ("case", "qkv ms", "dense ms", "torch ms", "qkv GB/s", "dense GB/s", "torch GB/s",
                    "copy GB/s", "qkv/copy"):
            t.add_column(col, justify="left" if col == "case" else "right")
        sec = r["seconds"]
        gbs = {m: r["bytes"] / sec[m] / 1e9 if m in sec else None for m in METHODS}
        copy = r["copy_bytes_per_s"] / 1e9
        t.add_row("decode", *(_fmt(sec[m] * 1e3 if m in sec else None, ".2f") for m in METHODS),
                  *(_fmt(gbs[m], ".1f") for m in METHODS), f"{copy:.1f}", f"{gbs['qkv'] / copy:.2f}")
        con.print(t)
        con.print(f"copy GB/s: np.copyto of {r['bytes'] / MIB:.0f} MiB of float32 on the same threads, timed "
                  f"in the same loop; counting bytes read + written (STREAM), so it copies {copy / 2:.1f} GB/s")
    if results.get("encoder"):
        from .encoder import report as encoder_report
        con.print(encoder_report(results["encoder"], results["repeats"], results["threads"]))
    elif results.get("encoder_skipped"):
        con.print(f"encoder suite skipped: {results['encoder_skipped']} "
                  "(it needs: pip install 'qkv[models,test]')")


def plot(results: dict, path: str) -> None:
    from qkv.extras import require
    matplotlib = require("matplotlib", "viz")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = results["sweep"]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    for m in METHODS:
        pts = [(r["t"], r["seconds"][m]) for r in sweep if m in r["seconds"]]
        if pts:
            ax_t.plot(*zip(*pts), marker="o", label=m)
        pts = [(r["t"], r["peak"][m]["extra_bytes"] / MIB) for r in sweep if r["peak"].get(m)]
        if pts:
            ax_m.plot(*zip(*pts), marker="o", label=m)
    for ax, title in ((ax_t, "forward+backward time (s)"), (ax_m, "peak extra memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (one head, D=%d)" % sweep[0]["d"])
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
