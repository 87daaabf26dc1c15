"""The commands that run under ``mpiexec -n W`` (``qkv bench --suite ring|train-mpi``, ``qkv
train gpt --parallel``): how many ranks the launcher gave, and ``python -m mpi4py``'s rule that
an exception on one rank ends the whole job.

Launch either way; both end every rank within seconds when one rank raises::

    mpiexec -n 2 qkv train gpt --parallel context ...
    mpiexec -n 2 python -m mpi4py -m qkv train gpt --parallel context ...
"""
from __future__ import annotations

import os
from contextlib import contextmanager


def mpiexec_ranks() -> int:
    """The job size an MPI launcher gave this process (MPICH's or Open MPI's), 1 if none."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


@contextmanager
def abort_on_error(mpi: bool):
    """Yields this process's rank in ``MPI.COMM_WORLD`` (0 without ``mpi`` or mpi4py).

    With MPI, ``python -m mpi4py``'s rule (``mpi4py.run.set_abort_status``, what that runner
    calls): an exception that leaves the block (a ShapeError or UsageError included, which
    ``qkv.cli.main`` turns into exit status 2) makes this rank call ``MPI_Abort`` when it
    exits, which ends every rank of the job, instead of a normal finalize that the other
    ranks, blocked in a collective, would wait for forever."""
    try:
        from mpi4py import MPI
        from mpi4py.run import set_abort_status
    except ImportError:  # the caller said what runs without it
        mpi = False
    if not mpi:
        yield 0
        return
    try:
        yield MPI.COMM_WORLD.Get_rank()
    except BaseException as err:
        set_abort_status(err)
        raise
