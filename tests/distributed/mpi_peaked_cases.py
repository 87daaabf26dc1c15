"""Run under ``mpiexec -n W python -m mpi4py tests/distributed/mpi_peaked_cases.py``; driven by
test_distributed.py. Rows of P nearly one-hot (each query's own key dominates by a score gap
of 20-50): the ring's dq and dk against a cancellation-free float64 oracle
(tests/attention/peaked_oracle.py), in float64 and float32, beside the dense float32 error of
torch on the same inputs. Prints ``rank R peaked <dtype> dq E dk E dense E``."""
import os
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from qkv import distributed as dist

sys.path.insert(0, str(Path(__file__).parent.parent / "attention"))
from peaked_oracle import dense_float32_torch, one_hot_inputs, rel_err, stable_grads  # noqa: E402

comm = MPI.COMM_WORLD
r = comm.Get_rank()
OPTS = dict(causal=True, window=5, scale=0.625)

q, k, v, dout = one_hot_inputs(np.random.default_rng(7), T=8 * comm.Get_size())
dq_t, dk_t = stable_grads(dout, q, k, v, **OPTS)
for dtype in (np.float64, np.float32):
    a = [x.astype(dtype) for x in (q, k, v, dout)]
    sh = [dist.shard(x) for x in a]
    o, ls = dist.ring_attention(*sh[:3], return_lse=True, **OPTS)
    dq, dk, _ = dist.ring_attention_backward(sh[3], *sh[:3], o, ls, **OPTS)
    e_dq, e_dk = (rel_err(dist.unshard(g), t) for g, t in ((dq, dq_t), (dk, dk_t)))
    dense = dense_float32_torch(a, OPTS, (dq_t, dk_t))
    os.write(1, f"rank {r} peaked {np.dtype(dtype).name} dq {e_dq:.3e} dk {e_dk:.3e} "
                f"dense {dense[0]:.3e} {dense[1]:.3e}\n".encode())
