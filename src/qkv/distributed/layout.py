"""Which tokens of the global sequence each rank holds, and moving whole arrays to and from it.

The sequence of length T is cut into chunks of ``c`` tokens. For W ranks (W = 4 drawn)::

    contiguous  (W chunks, c = T/W)          zigzag  (2W chunks, c = T/2W)
    chunk:   0    1    2    3                chunk:  0  1  2  3  4  5  6  7
    rank:    0    1    2    3                rank:   0  1  2  3  3  2  1  0

With ``causal=True`` a query sees the keys before it, so under ``contiguous`` rank W-1
does W times the work of rank 0; under ``zigzag`` rank r holds chunks r and 2W-1-r, an
early and a late one, and every rank does the same work (Brandon et al.'s striped/zigzag
balance, the layout ring-flash-attention uses).

A rank's local array is its chunks in increasing chunk order along the sequence axis, so
``shard(np.arange(T)[:, None])[:, 0] == positions(T)``.
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, fmt_shape
from ..extras import require

LAYOUTS = ("zigzag", "contiguous")


def world(comm):
    """``comm`` (default ``MPI.COMM_WORLD``), its size W and this rank r."""
    if comm is None:
        require("mpi4py", "mpi")
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    return comm, comm.Get_size(), comm.Get_rank()


def check_layout(layout) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ShapeError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    return layout


def n_chunks(layout: str, size: int) -> int:
    """How many equal chunks the sequence is cut into."""
    return 2 * size if layout == "zigzag" else size


def chunk_ids(layout: str, size: int, rank: int) -> list:
    """The chunk indices rank ``rank`` holds, in increasing order."""
    if layout == "zigzag":
        return [rank, 2 * size - 1 - rank]
    return [rank]


def pieces(layout: str, size: int, rank: int, local: int) -> list:
    """``(global start, local start, length)`` of each contiguous piece a rank holds, where
    ``local`` is the rank's number of tokens."""
    ids = chunk_ids(layout, size, rank)
    c = local // len(ids)
    return [(i * c, n * c, c) for n, i in enumerate(ids)]


def check_length(name: str, t: int, layout: str, size: int) -> None:
    parts = n_chunks(layout, size)
    if t % parts:
        raise ShapeError(
            f"{name}: the sequence length T = {t} must divide into {parts} equal chunks "
            f"(layout {layout!r}, W = {size} ranks); pad it to a multiple of {parts} "
            f"and pass kv_lengths")


def positions(T, *, comm=None, layout="zigzag") -> np.ndarray:
    """Global positions (int64) of this rank's tokens of a sequence of length ``T``."""
    comm, size, rank = world(comm)
    layout = check_layout(layout)
    if isinstance(T, bool) or not isinstance(T, (int, np.integer)) or T < 1:
        raise ShapeError(f"T must be an int >= 1; got {T!r}")
    check_length("positions", int(T), layout, size)
    local = int(T) // size
    return np.concatenate([np.arange(g, g + n) for g, _, n in pieces(layout, size, rank, local)])


def _axis(x: np.ndarray, axis) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -x.ndim <= axis < x.ndim:
        raise ShapeError(f"axis must be an int in [-{x.ndim}, {x.ndim}) for x of shape "
                         f"{fmt_shape(x.shape)}; got {axis!r}")
    return int(axis) % x.ndim


def shard(x, *, comm=None, layout="zigzag", axis=-2) -> np.ndarray:
    """This rank's tokens of the whole array ``x`` (every rank passes the same ``x``):
    its chunks along ``axis`` (default the sequence axis of ``(..., T, D)``), in order."""
    comm, size, rank = world(comm)
    layout = check_layout(layout)
    x = np.asarray(x)
    ax = _axis(x, axis)
    check_length(f"shard(x of shape {fmt_shape(x.shape)}, axis={axis})", x.shape[ax], layout, size)
    local = x.shape[ax] // size
    idx = np.concatenate([np.arange(g, g + n) for g, _, n in pieces(layout, size, rank, local)])
    return np.take(x, idx, axis=ax)


def unshard(x, *, comm=None, layout="zigzag", axis=-2) -> np.ndarray:
    """The whole array on every rank, from each rank's tokens ``x`` (the inverse of
    :func:`shard`). Collective: every rank must call it with the same shape and dtype."""
    comm, size, rank = world(comm)
    layout = check_layout(layout)
    x = np.asarray(x)
    ax = _axis(x, axis)
    seen = comm.allgather((x.shape, x.dtype.str, ax))
    if any(s != seen[0] for s in seen):
        listing = ", ".join(f"rank {i}: {fmt_shape(s[0])} {np.dtype(s[1])}" for i, s in enumerate(seen))
        raise ShapeError(f"unshard: every rank must pass x of the same shape and dtype; got {listing}")
    local = x.shape[ax]
    if local % (n_chunks(layout, size) // size):
        raise ShapeError(f"unshard: layout {layout!r} holds 2 chunks per rank, so the local length "
                         f"along axis {axis} must be even; got {local}")
    front = np.ascontiguousarray(np.moveaxis(x, ax, 0))           # (local, ...)
    everyone = np.empty((size,) + front.shape, front.dtype)     # (W, local, ...)
    comm.Allgather(front, everyone)
    whole = np.empty((size * local,) + front.shape[1:], front.dtype)
    for r in range(size):
        for g, o, n in pieces(layout, size, r, local):
            whole[g:g + n] = everyone[r, o:o + n]
    return np.moveaxis(whole, 0, ax)
