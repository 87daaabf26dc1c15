"""``qkv experiment NAME``: the texts' measurements (scale), the cost of attention against T
(complexity), what linear attention can recall (recall) and which mixers recall many keys (mqar)."""
from __future__ import annotations

import json

from ..extras import require
from .common import UsageError, out_folder
from .progress import check_progress, progress_bar

SCALE_HELP = "why attention divides by sqrt(d_k): Var(q.k) grows like d_k, softmax saturates, its gradient vanishes"
COMPLEXITY_HELP = ("time and traced peak memory against T of dense, tiled, chunked and linear attention, "
                   "forward and forward+backward, and one decoding step")
RECALL_HELP = "the dictionary lookup learned by softmax and by linear attention as the pairs grow"
MQAR_HELP = ("multi-query associative recall (Zoology's models: a BaseConv layer then attention, linear, based, "
             "mamba2 (alone, as Zoology), "
             "gated_delta, rglru or an attention hybrid), at several widths and pair counts, a sweep of lrs and seeds")


# The experiments: name -> (one line, its options). The help, the subcommands and the command's
# HELP come from this one table.
EXPERIMENTS = {"scale": (SCALE_HELP, lambda p: _scale_arguments(p)),
               "complexity": (COMPLEXITY_HELP, lambda p: _complexity_arguments(p)),
               "recall": (RECALL_HELP, lambda p: _recall_arguments(p)),
               "mqar": (MQAR_HELP, lambda p: _mqar_arguments(p))}
HELP = f"the texts' experiments: {', '.join(EXPERIMENTS)} (qkv experiment --help: a line each)"


def add_arguments(parser) -> None:
    """One subparser an experiment, each with its own options (``qkv experiment NAME --help``)."""
    names = list(EXPERIMENTS)
    sub = parser.add_subparsers(dest="name", metavar="NAME", required=True,
                                help=f"{', '.join(names[:-1])} or {names[-1]} (qkv experiment NAME --help: its options)")
    for name, (line, arguments) in EXPERIMENTS.items():
        arguments(sub.add_parser(name, help=line, description=line))


def _scale_arguments(parser) -> None:
    from ..experiments.scale import DEFAULT_DK

    parser.add_argument("--d-k", type=int, nargs="+", default=list(DEFAULT_DK), metavar="N",
                        help=f"key sizes to measure (default {' '.join(map(str, DEFAULT_DK))})")
    parser.add_argument("--keys", type=int, default=32, help="keys per softmax row (default 32)")
    parser.add_argument("--samples", type=int, default=512, help="queries per d_k (default 512)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    parser.add_argument("--out", metavar="DIR", help="also write scale.json and scale.png here (needs qkv[viz])")


def _run_arguments(parser, name: str, quick: str = "under a minute") -> None:
    """What complexity, recall and mqar share: --quick, --seed, --out, --no-progress."""
    parser.add_argument("--quick", action="store_true", help=f"a short run ({quick})")
    parser.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    parser.add_argument("--out", metavar="DIR", help=f"write {name}.json and {name}.png here (default ./experiment-out)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress (a bar on a terminal, else a line every few seconds on stderr); needs no rich")


def _complexity_arguments(parser) -> None:
    _run_arguments(parser, "complexity")
    parser.add_argument("--memory-limit", type=float, metavar="MIB",
                        help="stop a method before a run predicted to trace more MiB (default 6144; --quick 1024)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="kernel and BLAS threads while measuring (default: as configured)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall-clock seconds (default), or this process's CPU seconds, which other processes "
                             "on a shared machine barely change")


def _recall_arguments(parser) -> None:
    _run_arguments(parser, "recall")


def _mqar_arguments(parser) -> None:
    from . import mqar

    _run_arguments(parser, "mqar", "attention against Mamba-2 at width 32, 4 pairs: under 3 minutes")
    mqar.add_arguments(parser)


def run(args) -> int:
    return {"scale": _scale, "complexity": _complexity, "recall": _recall, "mqar": _mqar}[args.name](args)


def _scale(args) -> int:
    from ..experiments.scale import format_table, plot, scale_experiment

    out = None
    if args.out:
        require("matplotlib", "viz")
        out = out_folder(args.out)
    rows = scale_experiment(args.d_k, n_keys=args.keys, n_samples=args.samples, seed=args.seed)
    print(format_table(rows, args.keys))
    if out is not None:
        record = {"n_keys": args.keys, "n_samples": args.samples, "seed": args.seed, "rows": rows}
        (out / "scale.json").write_text(json.dumps(record, indent=2))
        plot(rows, out / "scale.png", args.keys)
        print(f"\nwrote {out / 'scale.json'} and {out / 'scale.png'}")
    return 0


def _with_progress(args, label: str, total: int, work):
    """``work(progress)`` with progress shown (unless --no-progress)."""
    if args.no_progress:
        return work(None)
    with progress_bar(label, total) as update:
        return work(lambda *_: update())


def _complexity(args) -> int:
    from ..experiments.complexity import ComplexityConfig, complexity_experiment
    from ..experiments.complexity_report import format_table, plot

    cfg = ComplexityConfig.quick() if args.quick else ComplexityConfig()
    cfg.seed, cfg.threads, cfg.clock = args.seed, args.threads, args.clock
    if args.memory_limit is not None:
        if args.memory_limit <= 0:
            raise UsageError(f"--memory-limit must be > 0 MiB; got {args.memory_limit}")
        cfg.memory_limit_mib = args.memory_limit
    return _record(args, "complexity", cfg, complexity_experiment, format_table, plot)


def _recall(args) -> int:
    from ..experiments.recall import RecallConfig, format_table, plot, recall_experiment

    cfg = RecallConfig.quick() if args.quick else RecallConfig()
    cfg.seed = args.seed
    return _record(args, "recall", cfg, recall_experiment, format_table, plot)


def _mqar(args) -> int:
    from . import mqar

    return mqar.run(args)


def _record(args, name: str, cfg, experiment, format_table, plot) -> int:
    """Check ``cfg``, run ``experiment(cfg, progress=...)`` (with a bar unless --no-progress),
    print its table and write ``NAME.json`` and ``NAME.png`` into --out (default ./experiment-out)."""
    require("matplotlib", "viz")
    cfg.check()
    if not args.no_progress:
        check_progress()
    out = out_folder(args.out or "experiment-out")
    rec = _with_progress(args, name, cfg.n_steps, lambda p: experiment(cfg, progress=p))
    print(format_table(rec))
    (out / f"{name}.json").write_text(json.dumps(rec, indent=2))
    plot(rec, out / f"{name}.png")
    print(f"\nwrote {out / f'{name}.json'} and {out / f'{name}.png'}")
    return 0
