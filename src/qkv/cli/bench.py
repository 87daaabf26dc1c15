"""``qkv bench``: qkv's tiled attention against dense NumPy and PyTorch SDPA (the suite is qkv_benchmarks).

This module parses, checks the output paths before minutes of measuring, shows progress
and draws the tables; the measuring, the tables' content and the plot are in
``qkv_benchmarks`` (``suites``, ``report``).
"""
from __future__ import annotations

import json
import sys

from ..extras import require
from .common import UsageError, out_file, progress_bar

HELP = "qkv's tiled attention against dense NumPy and PyTorch SDPA: speed, memory, decoding"


def add_arguments(parser) -> None:
    from qkv_benchmarks.suites import FULL, QUICK, SUITES  # light: the measuring imports come with the run

    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, one run each: a smoke test of every path in seconds, not a measurement")
    parser.add_argument("--suite", action="append", choices=SUITES + ("all",),
                        help="which suite to run (repeatable; default: all, or all but encoder with --quick)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed runs per method and case; the median is reported "
                        f"(default {FULL['repeats']}, quick {QUICK['repeats']})")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for qkv and torch (default: os.cpu_count())")
    parser.add_argument("--no-torch", action="store_true", help="leave PyTorch out even if installed")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--plot", metavar="PNG", help="also draw the scaling sweep (needs qkv[viz])")
    parser.add_argument("--json", metavar="FILE", help="also write every measurement as JSON")


def run(args) -> int:
    require("rich", "cli")
    for option, value in (("--repeats", args.repeats), ("--threads", args.threads)):
        if value is not None and value < 1:
            raise UsageError(f"{option} must be >= 1; got {value}")
    if args.plot:
        require("matplotlib", "viz")
        out_file(args.plot, "--plot", (".png", ".svg", ".pdf"))
    if args.json:
        out_file(args.json, "--json")  # both checked before minutes of measuring, not after
    from qkv_benchmarks import report, suites

    plan = suites.plan(args.suite, quick=args.quick, repeats=args.repeats, threads=args.threads,
                       torch=not args.no_torch, memory=not args.no_memory)
    with progress_bar("qkv bench", suites.count_steps(plan), transient=True, stderr=True) as update:
        results = suites.run_suites(plan, progress=lambda advance, description=None:
                                    update(advance=advance, description=description))
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
