"""``qkv experiment NAME``: the texts' measurements (scale), the cost of attention against T
(complexity), what linear attention can recall (recall) and which mixers recall many keys (mqar)."""
from __future__ import annotations

import json

from ..extras import require
from .common import UsageError, out_folder
from .progress import check_progress, progress_bar

HELP = "the texts' measurements (scale: why divide by sqrt(d_k); complexity: cost against T; recall: linear vs softmax)"
SCALE_HELP = "why attention divides by sqrt(d_k): Var(q.k) grows like d_k, softmax saturates, its gradient vanishes"
COMPLEXITY_HELP = ("time and traced peak memory against T of dense, tiled, chunked and linear attention, "
                   "forward and forward+backward, and one decoding step")
RECALL_HELP = "the dictionary lookup learned by softmax and by linear attention as the pairs grow"
MQAR_HELP = ("multi-query associative recall (Zoology): 2-layer attention, linear, mamba2, gated_delta, rglru "
             "and attention hybrids at several widths and pair counts")


def add_arguments(parser) -> None:
    """One subparser an experiment, each with its own options (``qkv experiment NAME --help``)."""
    sub = parser.add_subparsers(dest="name", metavar="NAME", required=True,
                                help="scale, complexity, recall or mqar (qkv experiment NAME --help: its options)")
    _scale_arguments(sub.add_parser("scale", help=SCALE_HELP, description=SCALE_HELP))
    _complexity_arguments(sub.add_parser("complexity", help=COMPLEXITY_HELP, description=COMPLEXITY_HELP))
    _recall_arguments(sub.add_parser("recall", help=RECALL_HELP, description=RECALL_HELP))
    _mqar_arguments(sub.add_parser("mqar", help=MQAR_HELP, description=MQAR_HELP))


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
    _run_arguments(parser, "mqar", "3 mixers, width 64, 4 and 8 pairs at T 128: under 3 minutes")
    parser.add_argument("--mixers", nargs="+", metavar="M",
                        help="only these mixers (attention, linear, mamba2, gated_delta, rglru, attention+X; "
                             "default all nine)")
    parser.add_argument("--widths", type=int, nargs="+", metavar="N", help="only these widths (default 32 64 128)")
    parser.add_argument("--steps", type=int, metavar="N",
                        help="training steps of every model (default each mixer's own: attention 1000, the "
                             "recurrences 2500, the hybrids 2000; --quick 300)")
    parser.add_argument("--lr", type=float, metavar="LR",
                        help="peak learning rate of every model (default each mixer's own: 3e-3 for attention and "
                             "the hybrids, 1e-2 for the recurrences)")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="models trained at once, a process of one thread each (default 1; the same results)")
    parser.add_argument("--attention-conv", type=int, metavar="K",
                        help="taps of the short convolution before every attention layer, as in Zoology's models "
                             "(default 3; 0 = plain attention)")
    parser.add_argument("--stop-loss", type=float, metavar="L",
                        help="a model stops once its mean loss over one cycle of the tasks is below L: it has "
                             "solved MQAR (default 0.03; 0 = train every step)")


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
    import sys

    from ..experiments.mqar import MQARConfig, mqar_experiment
    from ..experiments.mqar_report import format_table, plot
    from ..models.training import Diverged

    cfg = MQARConfig.quick() if args.quick else MQARConfig()
    cfg.seed = args.seed
    for name in ("mixers", "widths"):
        if getattr(args, name):
            setattr(cfg, name, tuple(getattr(args, name)))
    for name in ("steps", "lr", "workers", "attention_conv", "stop_loss"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    try:
        return _record(args, "mqar", cfg, mqar_experiment, format_table, plot)
    except Diverged as err:  # as qkv train gpt: the step, what went non-finite, a lower lr; exit 1
        print(f"qkv experiment mqar: error: the model {getattr(err, 'model', '?')}: {err}.\nNothing was written "
              f"(mqar keeps no checkpoint: its record is written once every model is trained); run again with "
              f"a lower --lr", file=sys.stderr)
        return 1


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
