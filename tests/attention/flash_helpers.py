"""Helpers shared by the tiled-kernel tests: tile sizes, the public API run with given tiles,
and a spy on which path the kernels took."""
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest

import qkv
from qkv import api
from qkv.kernels import flash
from qkv.kernels.flash import backward_kernel, forward_kernel

SMALL = flash.Tiles(rows=8, scratch=128, bwd_rows=8, bwd_keys=16, stack_rows=4)  # key chunks of 16


def tiled(tiles):
    """The tiled kernel with these tile sizes, for the calls it is handed to."""
    return SimpleNamespace(forward=partial(flash.forward, tiles=tiles),
                           backward=partial(flash.backward, tiles=tiles))


@pytest.fixture
def spy(monkeypatch):
    """Counts what the kernels ran: forward ``bound`` tries, ``bound_redo`` (a row failed it),
    ``exact`` calls and the rows of each, ``precise`` tasks; backward ``normalised`` heads
    (rows that took the precise, self-normalised path)."""
    seen = {"bound": 0, "bound_redo": 0, "exact": 0, "exact_rows": [], "precise": 0, "normalised": 0}
    real_bound, real_exact = forward_kernel._fwd_bound, forward_kernel._fwd_exact
    real_precise, real_norm = forward_kernel._fwd_precise, backward_kernel._normalisers

    def bound(*a, **kw):
        res = real_bound(*a, **kw)
        seen["bound"] += 1
        seen["bound_redo"] += not res[-1].all()   # some row failed: the exact path redoes it
        return res

    def exact(qs, *a, **kw):
        seen["exact"] += 1
        seen["exact_rows"].append(qs.shape[0])
        return real_exact(qs, *a, **kw)

    def precise(*a, **kw):
        seen["precise"] += 1
        return real_precise(*a, **kw)

    def normalisers(*a, **kw):
        norm = real_norm(*a, **kw)
        seen["normalised"] += int(np.any(norm.l > 0, axis=-1).sum())
        return norm

    monkeypatch.setattr(forward_kernel, "_fwd_bound", bound)
    monkeypatch.setattr(forward_kernel, "_fwd_exact", exact)
    monkeypatch.setattr(forward_kernel, "_fwd_precise", precise)
    monkeypatch.setattr(backward_kernel, "_normalisers", normalisers)
    return seen


def both(q, k, v, dout, opts, method, tiles=None):
    """out, lse and (dq, dk, dv) through the public API, or with ``tiles`` through its steps
    (the same checks and sum-back) with the tiled kernel at those sizes."""
    if tiles is None:
        out, lse = qkv.attention(q, k, v, return_lse=True, method=method, **opts)
        grads = qkv.attention_backward(dout, q, k, v, out, lse, method=method, **opts)
        return out, lse, grads
    prob, kern = api.prepare(q, k, v, **opts), tiled(tiles)
    out, lse = api.Prepared(prob, kern).forward(return_lse=True)
    return out, lse, api.Prepared(prob, kern).backward(dout, out, lse)


def err(x, ref):
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref))


def float32_inputs(seed, sq, sk, dv, magnitude=1.0):
    """float32 ``q (sq)``, ``k (sk)``, ``v`` (sk's leading axes, ``dv`` wide); q and k times ``magnitude``."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(sq, dtype=np.float32) * np.float32(magnitude)
    k = rng.standard_normal(sk, dtype=np.float32) * np.float32(magnitude)
    v = rng.standard_normal(sk[:-1] + (dv,), dtype=np.float32)
    return q, k, v
