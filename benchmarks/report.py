"""What ``qkv bench`` shows, built from the results dict: header lines, tables as data, the plot.

Nothing here prints or imports a terminal library: :func:`header` and :func:`footer` give lines of
text, :func:`tables` gives :class:`Table` values (the command draws them with rich; ``str(t)``
is a plain-text rendering), and :func:`sweep_figure` draws a matplotlib ``Figure``
(without pyplot) for the caller to save.
"""
from __future__ import annotations

from . import hf_hybrid_suite, hybrid_report
from .attention import METHODS
from .table import Table, fmt as _fmt

MIB = 2 ** 20


def machine_line(m: dict, torch_version: str | None) -> str:
    """One line: the CPU and the vector level NumPy uses, the BLAS and its kernel, the exp
    path of qkv's kernel (and the CPU numba compiles for), and torch's own CPU capability."""
    blas = m["blas"]
    disabled = f", NPY_DISABLE_CPU_FEATURES={m['npy_disable_cpu_features']}" if m["npy_disable_cpu_features"] else ""
    torch = (f"torch {torch_version} ({m['torch_capability'] or '?'})" if torch_version
             else "torch not in this run")
    found = " ".join(m["numpy_simd"]["found"]) or "none"
    numba = f" (numba for {m['numba']})" if m.get("numba") else ""
    return (f"machine: {m['cpu'] or 'CPU'}, {m['cores']} cores; NumPy vector level {m['vector']} "
            f"(SIMD paths found: {found}{disabled}); "
            f"BLAS {blas.get('library', '?')} {blas.get('version', '')} kernel {blas.get('kernel', '?')}; "
            f"qkv exp path: {m['exp']}{numba}; {torch}")


def header(results: dict) -> list[str]:
    """The lines above the tables: run settings, machine, notes, FLOP convention."""
    ran = " and ".join(name for name, key in (("ring", "ring"), ("train-mpi", "train_mpi")) if results.get(key))
    ranks = f", {results['mpi_ranks']} MPI ranks ({ran or 'ring'} suite)" if results.get("mpi_ranks") else ""
    lines = [f"qkv bench: {results['threads']} threads{ranks}, median of {results['repeats']} runs"
             f"{' (quick sizes)' if results['quick'] else ''}",
             machine_line(results["machine"], results["torch"])]
    if results.get("note"):
        lines.append(f"note: {results['note']}")
    env = results["machine"]["blas"]["env"]
    if env:
        pinned = " ".join(f"{k}={v}" for k, v in env.items())
        lines.append(f"note: {pinned} is set, which pins OpenBLAS to that kernel and can slow NumPy; for the "
                     "machine's own speed run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE qkv bench")
    m = results["machine"]
    if m.get("torch_capability") == "AVX2" and m.get("cpu_avx512") and not m.get("mkl_enable_instructions"):
        # ATen's switch leaves torch's MKL products on the CPU's best: AVX-512 (and AMX) on an Intel CPU
        lines.append("note: torch's kernels run as AVX2 but its MKL products pick their own ISA (AVX-512 on an "
                     "Intel CPU); for an AVX2-only machine's torch also set MKL_ENABLE_INSTRUCTIONS=AVX2")
    lines.append("FLOP: forward 4·B·H·Tq·Tk·D (causal: half); forward+backward 3.5x forward")
    return lines


def tables(results: dict) -> list[Table]:
    """The tables of every suite that ran, in order."""
    out = []
    smoke = " (smoke-test sizes)" if results["quick"] else ""
    if results["main"]:
        s = results["main"][0]["shape"]
        t = Table(f"attention B={s['b']} H={s['h']} T={s['t']} D={s['d']} float32{smoke}",
                  ["case", "qkv s", "dense s", "torch s", "qkv GFLOP/s", "dense GFLOP/s", "torch GFLOP/s",
                   "qkv/torch", "products s", "bound"], left=1)
        for r in results["main"]:
            sec = r["seconds"]
            gf = {m: r["flop"] / sec[m] / 1e9 if m in sec else None for m in METHODS}
            ratio = sec["torch"] / sec["qkv"] if "torch" in sec else None
            bound = sec["torch"] / sec["products"] if "torch" in sec and "products" in sec else None
            t.rows.append([r["case"], *(_fmt(sec.get(m), ".4f") for m in METHODS),
                           *(_fmt(gf[m], ".1f") for m in METHODS), _fmt(ratio, ".2f"),
                           _fmt(sec.get("products"), ".4f"), _fmt(bound, ".2f")])
        t.notes.append("products s: qkv's matrix products alone, in its tiles and threads (benchmarks/products.py); "
                       "bound = torch s / products s, the most qkv/torch could be if the softmax cost nothing")
        out.append(t)
    if results.get("options"):
        t = Table(f"softcap and dropout: the tiled kernel's forward+backward with the option against without "
                  f"(same inputs, alternated){smoke}", ["case", "plain s", "with option s", "ratio", "budget"], left=1)
        for r in results["options"]:
            sec = r["seconds"]
            t.rows.append([r["case"], _fmt(sec["plain"], ".4f"), _fmt(sec["option"], ".4f"), _fmt(r["ratio"], ".2f"),
                           _fmt(r["budget"], ".2f")])
        out.append(t)
    if results["sweep"]:
        t = Table(f"scaling: forward+backward, one head, D={results['sweep'][0]['d']}, float32; "
                  f"peak extra memory = RSS high-water in a subprocess{smoke}",
                  ["T", "qkv s", "dense s", "torch s", "qkv MiB", "dense MiB", "torch MiB", "qkv/torch"])
        for r in results["sweep"]:
            sec, peak = r["seconds"], r["peak"]
            mib = {m: peak[m]["extra_bytes"] / MIB if peak.get(m) else None for m in METHODS}
            ratio = sec["torch"] / sec["qkv"] if "torch" in sec else None
            t.rows.append([str(r["t"]), *(_fmt(sec.get(m), ".4f") for m in METHODS),
                           *(_fmt(mib[m], ".1f") for m in METHODS), _fmt(ratio, ".2f")])
        out.append(t)
    if results["decode"]:
        out.append(_decode_table(results["decode"][0], smoke))
    if results.get("encoder"):
        out.append(encoder_table(results["encoder"], results["repeats"], results["threads"]))
    if results.get("torch_suite"):
        out.append(torch_table(results["torch_suite"], results["repeats"], results["threads"], smoke))
    if results.get("ring"):
        out.append(ring_table(results["ring"], results.get("ring_pingpong_gb_s"), smoke))
    if results.get("gpt"):
        out.append(gpt_table(results["gpt"], results["threads"], smoke))
    if results.get("train_mpi"):
        out.append(train_mpi_table(results["train_mpi"], smoke))
    if results.get("shapes"):
        out.append(shapes_table(results["shapes"], results["repeats"], results["threads"], smoke))
    if results.get("hf"):
        out.append(hf_table(results["hf"], results["repeats"], smoke))
    if results.get("cold"):
        out.append(cold_table(results["cold"]))
    if results.get("recurrent"):
        out.append(recurrent_table(results["recurrent"], results["repeats"], results["threads"], smoke))
    if results.get("hybrid"):
        out.append(hybrid_report.lm_table(results["hybrid"], results["threads"], smoke))
    if results.get("hf_hybrid"):
        out.append(hf_hybrid_suite.table(results["hf_hybrid"], results["repeats"], results["threads"], smoke))
    if results.get("hybrid_decode"):
        out.append(hybrid_report.decode_table(results["hybrid_decode"], results["repeats"], results["threads"], smoke))
    return out


def footer(results: dict) -> list[str]:
    """The lines below the tables: what was skipped and why."""
    return [f"{suite} suite skipped: {why}" for suite, why in results.get("skipped", {}).items()]


def _decode_table(r: dict, smoke: str) -> Table:
    s, sec = r["shape"], r["seconds"]
    gbs = {m: r["bytes"] / sec[m] / 1e9 if m in sec else None for m in METHODS}
    copy = r["copy_bytes_per_s"] / 2e9  # bytes copied a second: what a decode's reads are held against
    t = Table(f"decode: Tq=1 Tk={s['tk']} Hq={s['hq']} Hkv={s['hkv']} D={s['d']} float32; "
              f"GB/s of K and V read ({r['bytes'] / MIB:.0f} MiB a call){smoke}",
              ["case", "qkv ms", "dense ms", "torch ms", "qkv GB/s", "dense GB/s", "torch GB/s",
               "copy GB/s", "qkv/copy"], left=1)
    t.rows.append(["decode", *(_fmt(sec[m] * 1e3 if m in sec else None, ".2f") for m in METHODS),
                   *(_fmt(gbs[m], ".1f") for m in METHODS), f"{copy:.1f}", f"{gbs['qkv'] / copy:.2f}"])
    t.notes.append(f"copy GB/s: np.copyto of {r['bytes'] / MIB:.0f} MiB of float32 on the same threads, timed "
                   f"in the same loop, in bytes copied a second ({2 * copy:.1f} GB/s counting read + written, "
                   f"as STREAM does); qkv/copy: qkv's K and V read a second against it")
    return t


def encoder_table(rows: list[dict], repeats: int, threads: int) -> Table:
    """The rows of ``encoder.measure`` as a table."""
    t = Table(f"encoder benchmark (all-MiniLM-L6-v2), CPU, threads {threads}, medians of {repeats}; "
              "ratio = sentence-transformers time / qkv time",
              ["workload", "texts", "tokens", "GFLOP", "qkv s", "s-t s", "qkv GF/s", "s-t GF/s",
               "ratio s-t/qkv", "cpu ratio", "max err"], left=1)
    for r in rows:
        t.rows.append([r["workload"], str(r["texts"]), str(r["tokens"]), f"{r['gflop']:.1f}",
                       f"{r['qkv_s']:.3f}", f"{r['st_s']:.3f}", f"{r['qkv_gflops']:.1f}", f"{r['st_gflops']:.1f}",
                       f"{r['ratio']:.2f}", f"{r['cpu_ratio']:.2f}", f"{r['max_abs_err']:.1e}"])
    return t


def torch_table(rows: list[dict], repeats: int | None = None, threads: int | None = None, smoke: str = "") -> Table:
    """The rows of ``torch_suite.measure``: seconds, the two ratios, peak memory."""
    methods = list(rows[0]["seconds"])  # qkv.torch, qkv, sdpa: the order measure ran them in
    runs = f", medians of {repeats}" if repeats else ""
    t = Table(f"qkv.torch.attention against qkv on NumPy and PyTorch SDPA, float32, "
              f"{threads or '?'} threads{runs}; ratios are medians of the ratios within a repeat{smoke}",
              ["case", "pass", "qkv.torch s", "qkv (NumPy) s", "SDPA s", "qkv.torch ÷ qkv time",
               "SDPA ÷ qkv.torch time", "peak MiB qkv.torch / qkv / SDPA"], left=2)
    last = None
    for r in rows:
        sec, peak = r["seconds"], r.get("peak_mib")
        mib = "—" if not peak else " / ".join(_fmt(peak[m], ".0f") for m in methods)
        case = f"{r['case']}, {r['shape']}" if r["case"] != last else ""
        last = r["case"]
        t.rows.append([case, r["pass"], *(f"{sec[m]:.3f}" for m in methods),
                       f"{r['wrapper']:.2f}", f"{r['vs_sdpa']:.2f}", mib])
    return t


def ring_table(rows: list[dict], pingpong_gb_s: float | None = None, smoke: str = "") -> Table:
    """The rows of ``ring.suite``: ring against one process, balance, bytes and memory per rank."""
    r0 = rows[0]
    t = Table(f"ring attention over MPI: T={r0['T']} H={r0['H']} D={r0['D']} float32"
              f"{', causal' if r0['causal'] else ''}, {r0['threads']} kernel thread a rank; single = one "
              f"process, qkv.attention(method='flash') on W threads; medians{smoke}",
              ["W", "layout", "ring fwd s", "ring fwd+bwd s", "single fwd+bwd s", "ring ÷ single",
               "kernel time max ÷ min", "sent MiB/rank", "peak MiB/rank", "single peak MiB"], left=2)
    for r in rows:
        peaks = r["peak_mib"]
        lo, hi = min(peaks), max(peaks)
        t.rows.append([str(r["W"]), r["layout"], f"{r['ring_fwd_s']:.3f}", _fmt(r["ring_fwdbwd_s"], ".3f"),
                       _fmt(r.get("single_fwdbwd_s"), ".3f"), _fmt(r.get("ratio"), ".2f"),
                       _fmt(r["balance"], ".3f"), f"{r['sent_bytes'] / MIB:.1f}",
                       f"{hi:.0f}" if round(lo) == round(hi) else f"{lo:.0f}–{hi:.0f}",
                       _fmt(r.get("single_peak_mib"), ".0f")])
    t.notes.append("sent per rank: forward (W−1)·(|K|+|V|), backward (W−1)·(|K|+|V|) + W·(|dK|+|dV|)")
    if pingpong_gb_s:
        t.notes.append(f"ping-pong between ranks 0 and 1: {pingpong_gb_s:.2f} GB/s one way")
    return t


def train_mpi_table(rows: list[dict], smoke: str = "") -> Table:
    """The rows of ``train_mpi.suite``: W ranks against one process, the step's parts, bytes and memory."""
    r0 = rows[0]
    t = Table(f"GPT training over MPI: {r0['params']:,} parameters, batch {r0['B']} x T={r0['T']}, float32, "
              f"1 thread a rank; single = one process on W threads; medians{smoke}",
              ["W", "mode", "tokens/s", "single tokens/s", "÷ single", "step ms", "backward ms",
               "grad allreduce ms", "loss allreduce ms", "ring wait ms", "sent MiB/rank", "peak MiB/rank"], left=2)
    for r in rows:
        ms = lambda v: "—" if v is None else f"{1e3 * v:.1f}"  # noqa: E731
        t.rows.append([str(r["W"]), r["mode"], f"{r['tokens_per_s']:,.0f}", f"{r['single_tokens_per_s']:,.0f}",
                       f"{r['vs_single']:.2f}", ms(r["step_s"]), ms(r["backward_s"]), ms(r["allreduce_s"]),
                       ms(r["loss_allreduce_s"]), ms(r["ring_s"]), f"{r['sent_bytes'] / MIB:.2f}",
                       f"{max(r['peak_mib']):.0f}"])
    t.notes.append(f"gradient buffer {r0['grad_bytes'] / MIB:.2f} MiB; sent per rank: a ring Allreduce's "
                   "2(W−1)/W of it, plus for context n_layer·[2(W−1)(|K|+|V|) + W(|dK|+|dV|)] of the ring")
    return t


def gpt_table(rows: list[dict], threads: int | None = None, smoke: str = "") -> Table:
    """The rows of ``gpt_suite.measure``: time a step, tokens/s, peak memory, val loss, per model and recipe."""
    cpu = [r for r in rows if r["recipe"] == "cpu"]
    c = cpu[0]["config"]
    t = Table(f"GPT training, nanoGPT's CPU recipe: block {c['block_size']}, batch {c['batch_size']}, "
              f"{c['n_layer']} layers, {c['n_head']} heads, width {c['n_embd']}, vocab {cpu[0]['vocab']}, "
              f"{cpu[0]['params']:,} parameters, {c['dtype']}, AdamW; {cpu[0]['steps']} steps on {cpu[0]['data']}, "
              f"{threads or '?'} threads{smoke}",
              ["model", "recipe", "steps", "ms/step", "tokens/s", "peak MiB", "val loss", "step-1 loss"], left=2)
    for r in rows:
        t.rows.append([r["model"], r["recipe"], str(r["steps"]), _fmt(r["ms_per_step"], ".1f"),
                       _fmt(r["tokens_per_s"], ",.0f"), _fmt(r["peak_mib"], ".1f"), _fmt(r["val_loss"], ".4f"),
                       _fmt(r.get("first_loss"), ".4f")])
    by = {(r["model"], r["recipe"]): r for r in rows}
    for recipe in ("cpu", "gpu-size"):
        q, p = by.get(("qkv", recipe)), by.get(("torch", recipe))
        if q and p and q["ms_per_step"] and p["ms_per_step"]:
            t.notes.append(f"{recipe}: qkv time ÷ torch time {q['ms_per_step'] / p['ms_per_step']:.2f}"
                           + (f"; val loss qkv − torch {q['val_loss'] - p['val_loss']:+.4f}" if q["val_loss"] else ""))
    t.notes.append(f"ms/step: median of one training step (forward, backward, clipping, AdamW) after "
                   f"{cpu[0]['warmup_steps']} warm-up steps, the models alternating in blocks of 10 steps (the first of "
                   f"each left out) from the same weights on the same batches; val loss: {cpu[0]['eval_iters']} val batches after the last step, "
                   "the same for both; peak MiB: resident-set high-water of a fresh subprocess over building the "
                   "model and 3 training steps, above its resident set before")
    if any(r["recipe"] == "gpu-size" for r in rows):
        t.notes.append("gpu-size: nanoGPT's GPU recipe's shape (block 256, batch 64, 6 layers, 6 heads, width 384, "
                       "dropout 0.2, vocab 65): one step after a warm-up step, in a fresh subprocess per model")
    if not any(r["model"] == "torch" for r in rows):
        t.notes.append("torch: not in this run (not installed, or --no-torch)")
    return t


def shapes_table(rows: list[dict], repeats: int | None = None, threads: int | None = None, smoke: str = "") -> Table:
    """The rows of ``shapes_suite.measure``: seconds, GFLOP/s and torch ÷ qkv per shape, mask and pass."""
    runs = f", medians of {repeats}" if repeats else ""
    t = Table(f"training and serving shapes: qkv (method auto) against PyTorch SDPA, float32, "
              f"{threads or '?'} threads{runs}{smoke}",
              ["shape (B,H,T,D)", "mask", "pass", "qkv s", "torch s", "qkv GFLOP/s", "torch GFLOP/s",
               "bound", "torch ÷ qkv"], left=3)
    for r in rows:
        t.rows.append(["(" + ",".join(str(x) for x in r["shape"]) + ")", "causal" if r["causal"] else "full",
                       r["pass"], f"{r['qkv_s']:.5f}", f"{r['torch_s']:.5f}", f"{r['qkv_gflops']:.1f}",
                       f"{r['torch_gflops']:.1f}", _fmt(r.get("bound"), ".2f"), f"{r['ratio']:.2f}"])
    t.notes.append("torch ÷ qkv: the median over repeats of torch's time ÷ qkv's time in the same repeat "
                   "(above 1, qkv is faster)")
    t.notes.append("bound: the same for qkv's call with the row kernel's element-wise passes made free "
                   "(its products, copies, Python and threads alone; — without the fast extra)")
    return t


def hf_table(rows: list[dict], repeats: int | None = None, smoke: str = "") -> Table:
    """The rows of ``hf_suite.measure``: each implementation's time and qkv ÷ sdpa, qkv ÷ eager."""
    one = rows[0]["thread_cpu_s"] is not None
    clock = "CPU time of the one thread" if one else "wall clock"
    s = rows[0]["size"]
    runs = f", medians of {repeats}" if repeats else ""
    t = Table(f"Hugging Face decoders, hidden {s['hidden']}, {s['heads']} heads, {s['layers']} layers, "
              f"B={s['batch']} T={s['t']}, float32: attn_implementation qkv against sdpa and eager, "
              f"{rows[0]['threads']} thread(s), {clock}{runs}{smoke}",
              ["model", "pass", "qkv s", "sdpa s", "eager s", "qkv ÷ sdpa", "qkv ÷ eager", "wall qkv ÷ sdpa"], left=2)
    for r in rows:
        sec = r["thread_cpu_s"] or r["wall_s"]
        t.rows.append([r["family"], r["pass"], *(f"{sec[m]:.4f}" for m in ("qkv", "sdpa", "eager")),
                       f"{r['qkv_vs_sdpa']:.3f}", f"{r['qkv_vs_eager']:.3f}", f"{r['qkv_vs_sdpa_wall']:.3f}"])
    t.notes.append("qkv ÷ peer: the median over repeats of qkv's time ÷ the peer's in the same repeat (below 1, "
                   "qkv is faster; issue 22's target: qkv ÷ sdpa <= 1.1)")
    return t


def cold_table(rows: list[dict]) -> Table:
    """The cold suite (``cold.py``): per job, cold and warm wall and CPU seconds, what compiling cost, the kernels compiled."""
    t = Table("first call: cold (empty kernel cache, every kernel compiled) and warm (loaded), each a fresh process",
              ["job", "cold s", "cold CPU s", "warm s", "warm CPU s", "cold - warm CPU s", "kernels compiled",
               "compiling s", "notice cold/warm"], left=1)
    for r in rows:
        c, w = r["cold"], r["warm"]
        t.rows.append([r["job"], format(c["wall_s"], ".1f"), format(c["cpu_s"], ".1f"), format(w["wall_s"], ".1f"),
                       format(w["cpu_s"], ".1f"), format(c["cpu_s"] - w["cpu_s"], ".1f"), str(len(c["compiled"])),
                       format(sum(c["compiled"].values()), ".1f"),
                       f"{'yes' if c['notice'] else 'no'}/{'yes' if w['notice'] else 'no'}"])
    t.notes.append("CPU s: user + system seconds of the child process (a shared machine inflates wall seconds, "
                   "not these); compiling s: wall seconds inside numba's compiles, summed over the kernels")
    slow = sorted(((s, k) for r in rows for k, s in r["cold"]["compiled"].items()), reverse=True)[:8]
    if slow:
        t.notes.append("slowest kernels to compile: " + ", ".join(f"{k.rsplit('.', 1)[-1]} {s:.1f} s"
                                                                  for s, k in slow))
    return t


def sweep_figure(results: dict):
    """Time and peak extra memory against T (log-log), one line per method: a matplotlib
    ``Figure`` (extra ``viz``); the caller saves it."""
    from qkv.extras import figure

    sweep = results["sweep"]
    fig = figure(figsize=(10, 4))
    ax_t, ax_m = fig.subplots(1, 2)
    for m in METHODS:
        pts = [(r["t"], r["seconds"][m]) for r in sweep if m in r["seconds"]]
        if pts:
            ax_t.plot(*zip(*pts), marker="o", label=m)
        pts = [(r["t"], r["peak"][m]["extra_bytes"] / MIB) for r in sweep if r["peak"].get(m)]
        if pts:
            ax_m.plot(*zip(*pts), marker="o", label=m)
    quick = " (smoke-test sizes)" if results["quick"] else ""
    for ax, title in ((ax_t, "forward+backward time (s)"), (ax_m, "peak extra memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"T (one head, D={sweep[0]['d']})")
        ax.set_title(title + quick)
        ax.legend()
    fig.tight_layout()
    return fig


def recurrent_table(rows: list[dict], repeats: int | None = None, threads: int | None = None,
                    smoke: str = "") -> Table:
    """Seconds, peer ÷ qkv and the products bound per kernel, shape and pass; the growth slopes."""
    runs = f", medians of {repeats}" if repeats else ""
    t = Table(f"recurrences: qkv.recurrent against torch chunk forms, float32, {threads or '?'} threads{runs}{smoke}",
              ["kernel", "shape (B,H,T,D)", "pass", "qkv s", "peer s", "products s", "bound", "peer ÷ qkv"], left=3)
    for r in rows:
        if r["group"] == "layer":   # (B, T, hidden): a whole layer against transformers' module
            b, t_, hidden = r["shape"]
            shape = f"({b},T={t_},d={hidden})"
        else:
            b, h, t_or_l, d = r["shape"]
            shape = f"({b},{h},{'L=' if r['kernel'] == 'decode' else ''}{t_or_l},{d})"
        label = {"growth": "decay (growth)", "layer": f"{r['kernel']} layer"}.get(r["group"], r["kernel"])
        t.rows.append([label, shape, r["pass"],
                       f"{r['qkv_s']:.5f}", f"{r['peer_s']:.5f}", _fmt(r.get("products_s"), ".5f"),
                       _fmt(r.get("bound"), ".2f"), f"{r['ratio']:.2f}"])
    peers = {r["kernel"]: r["peer"] for r in rows}
    t.notes.append("peers: " + "; ".join(f"{k}: {v}" for k, v in peers.items()))
    t.notes.append("peer ÷ qkv: the median over repeats of the peer's time ÷ qkv's in the same repeat (above 1, "
                   "qkv is faster); bound: the same against the chunked form's matrix products alone")
    growth = [r for r in rows if r["group"] == "growth"]
    if growth:
        ts = [r["shape"][2] for r in growth]
        t.notes.append(f"growth in T ({ts[0]} to {ts[-1]}, forward): log-log slope qkv {growth[0]['slope_qkv']:.2f}, "
                       f"peer {growth[0]['slope_peer']:.2f} (1 = linear)")
    t.notes.append("decode: one token from a (B,H,D,D) state (qkv) against qkv.attention over L cached keys (peer)")
    if any(r["group"] == "layer" for r in rows):
        t.notes.append("layer: qkv.nn's layer built by from_hf from transformers' module, (B, T, d_model) in; "
                       "fwd+bwd: every parameter's gradient and the input's")
    return t
