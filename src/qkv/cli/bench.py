"""``qkv bench``: qkv's tiled attention against dense NumPy and PyTorch SDPA (the suite is qkv_benchmarks)."""
from __future__ import annotations

HELP = "qkv's tiled attention against dense NumPy and PyTorch SDPA: speed, memory, decoding"


def add_arguments(parser) -> None:
    from qkv_benchmarks.attention import add_arguments as add

    add(parser)


def run(args) -> int:
    from qkv_benchmarks.attention import run as run_bench

    return run_bench(args)
