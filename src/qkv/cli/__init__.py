"""The ``qkv`` command: one small module per subcommand that parses, calls the library, prints or writes.

A subcommand module has ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``, and keeps its heavy imports (matplotlib, torch, rich, ...) inside
``run`` so ``qkv --help`` stays fast. Nothing outside this package imports it.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..errors import ShapeError
from ..extras import MissingExtra
from .common import UsageError

# name -> module under qkv.cli. Add a line here (and a module) to add a subcommand.
SUBCOMMANDS = {
    "demo": "demo",
    "explain": "explain",
    "cache-table": "cache_table",
    "train": "train",
    "sample": "sample",
    "convert": "convert",
    "experiment": "experiment",
    "bench": "bench",
}


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="qkv", description="Self-attention, derived from scratch and built to be used.")
    parser.add_argument("--version", action="version", version=f"qkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        mod = importlib.import_module(f"{__name__}.{module}")
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    _no_abbreviations(parser)
    return parser


def _no_abbreviations(parser) -> None:
    """No flag is taken from a prefix of it (argparse's allow_abbrev), in every subcommand: ``--step 5``
    is not silently ``--steps 5``; it is refused with the nearest flag named (:func:`_unrecognized`)."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _no_abbreviations(sub)


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    nanogpt = []
    if argv[:2] == ["train", "gpt"]:  # nanoGPT's --name=value overrides, which argparse cannot spell
        from .nanogpt_args import split_overrides

        rest, nanogpt = split_overrides(argv[2:])
        argv = argv[:2] + rest
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _unrecognized(parser, argv, unknown)
    if nanogpt:
        args.nanogpt = nanogpt
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    if args.command != "bench":  # bench times the library as a script imports it, with the peer beside it
        from ..heap import keep_freed_memory

        keep_freed_memory()      # a process of qkv's own: freed arrays' pages stay mapped (qkv.heap)
    name = " ".join(["qkv", args.command] + ([args.task] if getattr(args, "task", None) else []))
    try:
        return int(args._run(args) or 0)
    except (ShapeError, MissingExtra, UsageError) as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the shell's status for SIGINT, and no traceback
        print(f"\n{name}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `qkv demo | head`: the reader left; not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush cannot fail again
        return 0


def _unrecognized(parser, argv: list[str], unknown: list[str]) -> None:
    """argparse's error for ``unknown`` arguments, from the subcommand they were given to (its
    usage, not the top level's), with the nearest flag of that subcommand for a misspelt one."""
    import difflib

    for token in argv:  # down the subcommands named on the line: qkv train gpt ...
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            break
        if token in subs[0].choices:
            parser = subs[0].choices[token]
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for arg in unknown:
        if arg.startswith("-"):
            typed = arg.split("=", 1)[0]
            near = sorted(f for f in flags if f.startswith(typed))  # an abbreviation: the flags it begins
            near = near or difflib.get_close_matches(typed, flags, n=1, cutoff=0.6)
            if near:
                hints.append(f"{arg}: did you mean {' or '.join(near[:3])}?")
    parser.error(f"unrecognized arguments: {' '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else ""))
