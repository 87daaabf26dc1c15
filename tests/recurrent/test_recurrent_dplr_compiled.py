"""dplr's compiled float32 backward (qkv.recurrent.generalized_delta.compiled: chunk_grads, and
scores_backward with a decay a channel) against the float64 step oracle, each gradient within a
budget of the NumPy path's own float32 error: mild, steep (-30 a step) and zero decays, a decay a
channel and one a head, an initial state and dstate, T not a multiple of the chunk, B, H > 1,
several groups of chunks."""
import numpy as np
import pytest

from compiled_budget import check_within_budget, compiled_or_skip
from qkv import jit
from qkv.recurrent import dplr_backward
from qkv.recurrent.generalized_delta import backward as dplr_bwd, chunk_parts, naive




def _inputs(B, H, T, Dk, Dv, decay, per_head, state, seed=0):
    """RWKV-7-like: ``a = -k̂``, ``b = k̂ ∘ α`` (a normalised key, a rate in (0, 1))."""
    rng = np.random.default_rng(seed + T + Dk)
    q, k = rng.standard_normal((B, H, T, Dk)), rng.standard_normal((B, H, T, Dk))
    kh = k / np.linalg.norm(k, axis=-1, keepdims=True)
    a, b = -kh, kh * rng.uniform(0, 1, (B, H, T, Dk))
    v, do = rng.standard_normal((B, H, T, Dv)), rng.standard_normal((B, H, T, Dv))
    shape = (B, H, T) if per_head else (B, H, T, Dk)
    g = {"mild": -np.exp(-0.5) * rng.uniform(0, 1, shape), "steep": np.full(shape, -30.0),
         "zero": np.zeros(shape)}[decay]
    if decay == "mild":
        g[rng.uniform(size=shape) < 0.05] = -30.0                    # a few steps forget almost everything
    S0, dS = (rng.standard_normal((B, H, Dk, Dv)) if state else None for _ in range(2))
    return q, k, v, a, b, g, S0, do, dS



@pytest.mark.parametrize("B, H, T, Dk, Dv, chunk", [(1, 2, 96, 16, 24, 32), (2, 3, 77, 32, 16, None),
                                                    (2, 2, 50, 8, 8, 16), (1, 1, 5, 4, 6, None)])
@pytest.mark.parametrize("decay", ["mild", "steep", "zero"])
@pytest.mark.parametrize("per_head", [False, True], ids=["a channel", "a head"])
@pytest.mark.parametrize("state", [True, False], ids=["state", "no-state"])
def test_compiled_backward_within_budget_of_the_numpy_path(monkeypatch, B, H, T, Dk, Dv, chunk, decay, per_head,
                                                           state):
    mod = compiled_or_skip(jit.DPLR)
    q, k, v, a, b, g, S0, do, dS = _inputs(B, H, T, Dk, Dv, decay, per_head, state)
    want = naive.dplr_backward(do, dS, q, k, v, a, b, g, scale=0.7, initial_state=S0)
    x32 = [None if x is None else x.astype(np.float32) for x in (do, q, k, v, a, b, g, S0, dS)]
    do32, q32, k32, v32, a32, b32, g32, S032, dS32 = x32
    monkeypatch.setattr(chunk_parts, "GROUP_ELEMENTS", 2 * Dk * 16)   # several groups of chunks
    calls = {"chunks": 0, "scores": 0}
    real_chunks, real_scores = mod.chunk_grads, mod.scores_backward

    def count(name, real):
        def call(*args):
            calls[name] += 1
            return real(*args)
        return call
    monkeypatch.setattr(mod, "chunk_grads", count("chunks", real_chunks))
    monkeypatch.setattr(mod, "scores_backward", count("scores", real_scores))
    kw = dict(scale=0.7, initial_state=S032, dstate=dS32, chunk_size=chunk)
    got = dplr_backward(do32, q32, k32, v32, a32, b32, g32, **kw)
    assert calls["chunks"] >= 1 and calls["scores"] == (0 if per_head else calls["chunks"]), calls
    monkeypatch.setattr(dplr_bwd, "_compiled", lambda *args: None)
    plain = dplr_backward(do32, q32, k32, v32, a32, b32, g32, **kw)
    check_within_budget(["dq", "dk", "dv", "da", "db", "dg", "dS0"], got, plain, want, absent=() if state else ("dS0",))


@pytest.mark.parametrize("halves", [True, False], ids=["halves", "stacked"])
def test_both_layouts_of_the_state_products_within_budget(monkeypatch, halves):
    """``[u; v] dS_outᵀ`` and ``[dO; dU] S_inᵀ`` as two products of C rows each (where OpenBLAS has
    small-matrix kernels) or stacked (elsewhere): whichever this machine's BLAS picks, the other is tested too."""
    from qkv import threads
    mod = compiled_or_skip(jit.DPLR)
    q, k, v, a, b, g, S0, do, dS = _inputs(2, 2, 77, 32, 24, "mild", False, True, seed=1)
    want = naive.dplr_backward(do, dS, q, k, v, a, b, g, scale=0.7, initial_state=S0)
    x32 = [x.astype(np.float32) for x in (do, q, k, v, a, b, g)]
    kw = dict(scale=0.7, initial_state=S0.astype(np.float32), dstate=dS.astype(np.float32))
    monkeypatch.setattr(threads, "small_products", lambda: halves)
    seen = []
    real = mod.chunk_grads
    monkeypatch.setattr(mod, "chunk_grads", lambda *args: seen.append(args[-1]) or real(*args))
    got = dplr_backward(*x32, **kw)
    assert seen and set(seen) == {halves}
    monkeypatch.setattr(dplr_bwd, "_compiled", lambda *args: None)
    plain = dplr_backward(*x32, **kw)
    check_within_budget(["dq", "dk", "dv", "da", "db", "dg", "dS0"], got, plain, want)


def test_float64_takes_the_numpy_path(monkeypatch):
    mod = compiled_or_skip(jit.DPLR)
    monkeypatch.setattr(mod, "chunk_grads", lambda *args: pytest.fail("float64 ran the compiled pass"))
    q, k, v, a, b, g, S0, do, dS = _inputs(1, 2, 40, 8, 8, "mild", False, True)
    dplr_backward(do, q, k, v, a, b, g, initial_state=S0, dstate=dS)


@pytest.mark.parametrize("path", ["compiled", "numpy"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pass_a_kept_or_made_again_gives_the_same_bits(monkeypatch, path, dtype):
    """The backward keeps the groups' pass (a) up to KEEP_BYTES and makes the rest again: the same
    arithmetic, so the gradients do not depend on how many were kept."""
    if path == "numpy":
        monkeypatch.setattr(dplr_bwd, "_compiled", lambda *args: None)
    q, k, v, a, b, g, S0, do, dS = (None if x is None else x.astype(dtype)
                                    for x in _inputs(2, 2, 90, 16, 8, "mild", False, True))
    monkeypatch.setattr(chunk_parts, "GROUP_ELEMENTS", 2 * 2 * 16 * 16)   # 6 groups of chunks
    runs = []
    for keep in (1 << 40, 0, 3 * 4 * 2 * 2 * 16 * 16 * 16):              # all, none, some
        monkeypatch.setattr(dplr_bwd, "KEEP_BYTES", keep)
        runs.append(dplr_backward(do, q, k, v, a, b, g, initial_state=S0, dstate=dS, chunk_size=8))
    for got in runs[1:]:
        for x, y in zip(runs[0], got):
            assert np.array_equal(x, y)
