"""``qkv bench``: qkv's tiled attention against dense NumPy and PyTorch SDPA (the suite is qkv_benchmarks).

This module parses, checks the output paths before minutes of measuring, shows progress
(a bar with the time left on a terminal, a line every few seconds elsewhere: ``progress``)
and draws the tables; the measuring, the tables' content and the plot are in
``qkv_benchmarks`` (``suites``, ``report``).

**Under MPI** (``mpiexec -n W qkv bench --suite ring|train-mpi``) every rank runs this command; rank 0
alone checks and writes the output files and prints. The command then has the semantics of
``python -m mpi4py``: an exception on any rank (an output path only rank 0 finds bad
included) ends the whole job with ``MPI_Abort`` when that rank exits, instead of leaving the other ranks waiting in a
collective forever. Other suites refuse to run under mpiexec without the ring: every rank
would run them at once, on the same cores.
"""
from __future__ import annotations

import json
import os
import sys

from ..extras import require
from .common import UsageError, out_file
from .mpi import abort_on_error, mpiexec_ranks
from .progress import check_progress, progress_bar

HELP = ("qkv's tiled attention against dense NumPy and PyTorch SDPA: speed, memory, decoding; "
        "qkv.torch against SDPA; ring attention over MPI; GPT training against PyTorch")


def add_arguments(parser) -> None:
    import argparse

    from qkv_benchmarks.suites import DEFAULT, FULL, QUICK, QUICK_DEFAULT, SUITE_HELP, SUITES  # light: the measuring imports come with the run

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    width = max(map(len, SUITES))
    parser.epilog = "suites (--suite NAME):\n" + "\n".join(f"  {s:<{width}}  {SUITE_HELP[s]}" for s in SUITES)

    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, one run each: a smoke test of every path in seconds, not a measurement")
    parser.add_argument("--suite", action="append", choices=SUITES + ("all",),
                        help=f"which suite to run (repeatable; default: {', '.join(DEFAULT)}; with --quick: "
                        f"{', '.join(QUICK_DEFAULT)}; 'all': every suite; ring and train-mpi run under mpiexec -n W)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed runs per method and case; the median is reported "
                        f"(default {FULL['repeats']}, quick {QUICK['repeats']})")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for qkv and torch (default: os.cpu_count()); the ring suite runs one "
                        "kernel thread a rank and its single-process peer W threads")
    parser.add_argument("--no-torch", action="store_true", help="leave PyTorch out even if installed")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--no-gpu-size", action="store_true",
                        help="gpt suite: leave out the step at nanoGPT's GPU recipe's size (block 256, batch 64, "
                        "6 layers, width 384: minutes a side on a 2-core CPU)")
    parser.add_argument("--steps", type=int, default=None,
                        help="gpt and hybrid suites: training steps of each model (default 2000, quick 5)")
    parser.add_argument("--data", metavar="FILE", default=None,
                        help="gpt and hybrid suites: the text to train on (default: the Shakespeare corpus, fetched once; "
                        "quick: a built-in text)")
    parser.add_argument("--plot", metavar="PNG", help="also draw the scaling sweep (needs qkv[viz])")
    parser.add_argument("--json", metavar="FILE", help="also write every measurement as JSON")


def run(args) -> int:
    require("rich", "cli")  # the tables, and the bar on a terminal
    check_progress(switch=None)
    for option, value in (("--repeats", args.repeats), ("--threads", args.threads), ("--steps", args.steps)):
        if value is not None and value < 1:
            raise UsageError(f"{option} must be >= 1; got {value}")
    if args.data is not None and not os.path.isfile(args.data):
        raise UsageError(f"--data must be a text file; {args.data!r} is not one")
    from qkv_benchmarks import report, suites

    plan = suites.plan(args.suite, quick=args.quick, repeats=args.repeats, threads=args.threads,
                       torch=not args.no_torch, memory=not args.no_memory, steps=args.steps,
                       gpu_size=not args.no_gpu_size,
                       data=os.path.abspath(args.data) if args.data else None)
    mpi = bool(set(suites.MPI_SUITES) & set(plan.suites))
    if not mpi and mpiexec_ranks() > 1:
        raise UsageError(f"under mpiexec only --suite ring runs (or --suite train-mpi; with {mpiexec_ranks()} ranks "
                         "every other suite would run once per rank, all at once on the same cores)")
    with abort_on_error(mpi) as rank:
        return _measure(args, plan, rank, report, suites)


def _measure(args, plan, rank: int, report, suites) -> int:
    if rank == 0:  # only rank 0 writes: checked before minutes of measuring, not after
        if args.plot:
            require("matplotlib", "viz")
            out_file(args.plot, "--plot", (".png", ".svg", ".pdf"))
        if args.json:
            out_file(args.json, "--json")
        with progress_bar("qkv bench", suites.count_steps(plan), transient=True, switch=None) as update:
            results = suites.run_suites(plan, progress=lambda advance, description=None:
                                        update(advance=advance, description=description))
    else:
        results = suites.run_suites(plan)
    if results is None:  # a rank other than 0: rank 0 reports
        return 0
    _show(results, report)
    if args.plot and results["sweep"]:
        report.sweep_figure(results).savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"json: {args.json}")
    return 0


def _show(results: dict, report) -> None:
    """The header, each table drawn by rich, the footer, on standard output."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    # A wide console when not a terminal, so piped tables are never wrapped or cut.
    con = Console(width=None if sys.stdout.isatty() else 200)
    for line in report.header(results):
        con.print(line, markup=False, soft_wrap=True)
    for t in report.tables(results):
        table = Table(title=t.title, box=box.SIMPLE)
        for i, col in enumerate(t.columns):
            table.add_column(col, justify="left" if i < t.left else "right")
        for row in t.rows:
            table.add_row(*row)
        con.print(table)
        for line in t.notes:
            con.print(line, markup=False, soft_wrap=True)
    for line in report.footer(results):
        con.print(line, markup=False, soft_wrap=True)
