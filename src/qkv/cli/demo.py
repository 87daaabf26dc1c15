"""``qkv demo``: the texts' worked examples, step by step, checked against what they print."""
from __future__ import annotations

from .common import out_file

HELP = "the texts' worked examples, step by step, checked"


def add_arguments(parser) -> None:
    parser.add_argument("--plot", metavar="FILE.png", help="also write a heatmap of the weights")


def run(args) -> int:
    from ..experiments import worked

    if args.plot:
        out_file(args.plot, "--plot", (".png", ".svg", ".pdf"))  # a bad path fails before the report
    print(worked.report())
    if args.plot:
        worked.plot(args.plot)
        print(f"\nwrote {args.plot}")
    return 0
