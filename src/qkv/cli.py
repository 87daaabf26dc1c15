"""The ``qkv`` command: one subcommand per job, each living in the module that owns it.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``, and keeps
its heavy imports (matplotlib, torch, rich, ...) inside ``run`` so ``qkv --help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

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


def out_folder(path, option: str = "--out") -> Path:
    """Make ``path`` a folder (parents too) before any work is done, or raise a ShapeError naming ``option``."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ShapeError(f"{option} must be a folder qkv can write to; {str(folder)!r}: {err.strerror}") from None
    return folder


def out_file(path, option: str, suffixes: tuple[str, ...] = ()) -> Path:
    """``path`` as a file qkv can write: one of ``suffixes`` (if given), in an existing folder."""
    file = Path(path)
    if suffixes and file.suffix.lower() not in suffixes:
        raise ShapeError(f"{option} must end in {' or '.join(suffixes)}; got {str(file)!r}")
    if file.is_dir():
        raise ShapeError(f"{option} must be a file name; {str(file)!r} is a folder")
    if not file.parent.is_dir():
        raise ShapeError(f"{option} must be in an existing folder; {str(file.parent)!r} is not one")
    return file


if __name__ == "__main__":  # python -m qkv.cli
    sys.exit(main())
