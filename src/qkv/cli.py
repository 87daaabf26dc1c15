"""The ``qkv`` command: one subcommand per job, each living in the module that owns it.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``, and keeps
its heavy imports (matplotlib, torch, rich, ...) inside ``run`` so ``qkv --help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import ShapeError

# name -> (module, one-line help). Add a line here to add a subcommand.
SUBCOMMANDS = {
    "demo": ("qkv.demo", "the texts' worked examples, step by step, checked"),
    "explain": ("qkv.explain", "what a pretrained model (all-MiniLM-L6-v2) attends to: HTML explorer, PNG, per-layer text"),
    "cache-table": ("qkv.nn.cache", "KV-cache bytes per token of MHA, GQA, MQA and MLA at one width"),
    "train": ("qkv.train", "learn the texts' soft dictionary lookup with qkv.nn (train lookup)"),
    "experiment": ("qkv.experiment", "the texts' measurements (experiment scale: why divide by sqrt(d_k))"),
    "bench": ("qkv_benchmarks.attention", "qkv's tiled attention against dense NumPy and PyTorch SDPA: speed, memory, decoding"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qkv", description="Self-attention, derived from scratch and built to be used.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    try:
        return int(args._run(args) or 0)
    except (ShapeError, MissingExtra) as err:
        print(f"qkv {args.command}: error: {err}", file=sys.stderr)
        return 2


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message says which extra brings it."""


def require(module: str, extra: str):
    """Import an optional dependency or raise MissingExtra naming ``pip install 'qkv[extra]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtra(
            f"this needs the optional dependency '{module.split('.')[0]}' ({err}); "
            f"install it with: pip install 'qkv[{extra}]'"
        ) from None


if __name__ == "__main__":  # python -m qkv.cli
    sys.exit(main())
