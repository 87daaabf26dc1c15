"""Ring attention over an MPI communicator (extra ``mpi``: mpi4py with the mpich wheel).

The sequence is split over the W ranks of a communicator (``comm=None`` is
``MPI.COMM_WORLD``); each rank holds its tokens of q, k and v in one of two layouts
(:mod:`.layout` draws them) and the keys travel around the ring (:mod:`.ring`)::

    x_local = qkv.distributed.shard(x)                 # this rank's tokens of a whole array
    out, lse = qkv.distributed.ring_attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = qkv.distributed.ring_attention_backward(dout, q, k, v, out, lse, causal=True)
    whole = qkv.distributed.unshard(out)               # the whole array, on every rank
    layer = qkv.distributed.RingMultiHeadAttention(64, 8, causal=True, rope=True, rng=rng)

Run with ``mpiexec -n W python -m mpi4py script.py``: ``-m mpi4py`` ends the whole job
when any rank raises, so no rank is left waiting for a message that never comes.
"""
from .layer import RingMultiHeadAttention
from .layout import positions, shard, unshard
from .ring import ring_attention, ring_attention_backward

__all__ = ["shard", "unshard", "positions", "ring_attention", "ring_attention_backward",
           "RingMultiHeadAttention"]
