"""``qkv experiment mqar``: its options, and the run spread over ``--workers`` processes or MPI ranks.

Under ``mpiexec -n N`` (``PMI_SIZE`` or ``OMPI_COMM_WORLD_SIZE`` > 1) the same command spreads
its runs over the ranks (:mod:`qkv.experiments.mqar_runs`); rank 0 prints and writes the record.
"""
from __future__ import annotations

import json
import sys

from ..extras import require
from .common import UsageError, out_folder
from .mpi import abort_on_error, mpiexec_ranks
from .progress import check_progress, progress_bar


def add_arguments(parser) -> None:
    parser.add_argument("--mixers", nargs="+", metavar="M",
                        help="only these mixers (attention, linear, based, mamba2, gated_delta, rglru, attention+X; "
                             "default all eleven)")
    parser.add_argument("--widths", type=int, nargs="+", metavar="N", help="only these widths (default 32 64)")
    parser.add_argument("--pairs", type=int, nargs="+", metavar="P", help="pair counts (default 4 8 16)")
    parser.add_argument("--seq-len", type=int, metavar="T", help="the test sequences' length (default 128)")
    parser.add_argument("--steps", type=int, metavar="N", help="training steps of every model (default 1000)")
    parser.add_argument("--batch", type=int, metavar="N", help="sequences a step (default 32)")
    parser.add_argument("--lrs", type=float, nargs="+", metavar="LR",
                        help="the learning rates swept for each model (default 1e-3 3e-3 1e-2); the best on "
                             "validation is kept")
    parser.add_argument("--seeds", type=int, nargs="+", metavar="S",
                        help="seeds: the first for the sweep, all for the chosen lr (default: --seed and the two "
                             "after it)")
    parser.add_argument("--vocab-size", type=int, metavar="V", help="vocabulary (default 8192, Zoology's)")
    parser.add_argument("--filler", choices=["random", "zero"], help="what the non-query positions hold (random)")
    parser.add_argument("--baseconv", type=int, metavar="K",
                        help="taps of the BaseConv layer before every mixer (default 3; 0 = none)")
    parser.add_argument("--stop-accuracy", type=float, metavar="A",
                        help="a model stops once its validation accuracy is above A (default 0.99; above 1: never)")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="runs at once, a process of one thread each (default 1; the same results)")


def configure(args):
    """The :class:`~qkv.experiments.mqar.MQARConfig` the arguments ask for."""
    from ..experiments.mqar import MQARConfig

    cfg = MQARConfig.quick() if args.quick else MQARConfig()
    cfg.seeds = tuple(args.seed + i for i in range(len(cfg.seeds)))
    for name in ("mixers", "widths", "pairs", "lrs", "seeds"):
        if getattr(args, name):
            setattr(cfg, name, tuple(getattr(args, name)))
    for name in ("seq_len", "steps", "batch", "vocab_size", "filler", "baseconv", "stop_accuracy", "workers"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    return cfg


def run(args) -> int:
    from ..experiments.mqar_report import format_table, plot, quick_finding
    from ..experiments.mqar_runs import KEPT, Kept, mqar_experiment

    require("matplotlib", "viz")
    cfg = configure(args)
    cfg.check()
    mpi = mpiexec_ranks() > 1
    with abort_on_error(mpi) as rank:
        comm = None
        if mpi:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        show = rank == 0 and not args.no_progress
        if show:
            check_progress()
        out = out_folder(args.out or "experiment-out") if rank == 0 else None
        if rank == 0:
            print(f"qkv experiment mqar: {cfg.runs()} runs ({len(cfg.mixers)} mixers x {len(cfg.widths)} widths x "
                  f"({len(cfg.lrs)} lrs + {len(cfg.seeds) - 1} more seeds)), {cfg.steps} steps of {cfg.batch} at most, "
                  f"tasks {cfg.tasks()}, vocabulary {cfg.vocab_size}"
                  + (f", over {comm.Get_size()} MPI ranks" if comm else f", {cfg.workers} worker(s)"), flush=True)
        kept = None if mpi else Kept(out / KEPT, cfg)      # each finished run, kept as it ends
        if kept is not None and kept.done:
            print(f"qkv experiment mqar: {len(kept.done)} run(s) of this config kept in {kept.path} from an "
                  f"interrupted call: taken as they are, the other {cfg.runs() - len(kept.done)} trained", flush=True)
        if show:
            with progress_bar("mqar", cfg.runs()) as update:
                rec = mqar_experiment(cfg, progress=lambda *_: update(), comm=comm, kept=kept)
        else:
            rec = mqar_experiment(cfg, comm=comm, kept=kept)
        if rank != 0:
            return 0
    lost = _diverged_everywhere(rec)
    if lost:
        print(f"qkv experiment mqar: {lost}; nothing was written: try lower --lrs", file=sys.stderr)
        return 1
    print(format_table(rec))
    if args.quick:
        print(quick_finding(rec))
    (out / "mqar.json").write_text(json.dumps(rec, indent=2))
    plot(rec, out / "mqar.png")
    if kept is not None:
        kept.remove()
    print(f"\nwrote {out / 'mqar.json'} and {out / 'mqar.png'}")
    return 0


def _diverged_everywhere(rec: dict) -> str | None:
    """The first model none of whose runs kept finite numbers, said with where it diverged; None."""
    by_model = {}
    for r in rec["runs"]:
        by_model.setdefault((r["mixer"], r["width"]), []).append(r)
    for (mixer, width), runs in by_model.items():
        if all(r["diverged"] for r in runs):
            lrs = ", ".join(f"{r['lr']:g}" for r in runs)
            return f"the model {mixer} at width {width} diverged at every lr ({lrs}): {runs[0]['diverged_at']}"
    return None


__all__ = ["UsageError", "add_arguments", "configure", "run"]
