"""The decay recurrence's compiled float32 backward (qkv.recurrent.decay.compiled: backward_states,
then backward_chunks, driven by qkv.recurrent.decay.fused.backward) against the float64 step oracle,
each gradient within a budget of the NumPy path's own float32 error: a decay a head, mild, steep
(-30 a step), none (g = 0) and mixed; T a multiple of the chunk (the gradients written in place) and
not; one work unit and one a head; with and without an initial state and dstate."""
import numpy as np
import pytest

from compiled_budget import compiled_or_skip, counted, decay_case, decay_cases
from qkv import jit
from qkv.recurrent.decay import chunk as decay



def _inputs(B, H, T, Dk, Dv, decays, state, seed=0):
    rng = np.random.default_rng(seed + T + Dk)
    q, k = rng.standard_normal((B, H, T, Dk)), rng.standard_normal((B, H, T, Dk))
    v, do = rng.standard_normal((B, H, T, Dv)), rng.standard_normal((B, H, T, Dv))
    g = {"mild": -rng.uniform(0, 1.5, (B, H, T)), "steep": np.full((B, H, T), -30.0),
         "none": np.zeros((B, H, T)), "mixed": -rng.uniform(0, 1, (B, H, T))}[decays]
    if decays == "mixed":
        g[rng.uniform(size=g.shape) < 0.15] = -30.0                # some steps forget almost everything
        g[rng.uniform(size=g.shape) < 0.15] = 0.0                  # some none
    S0, dS = (rng.standard_normal((B, H, Dk, Dv)) if state else None for _ in range(2))
    return q, k, v, g, S0, do, dS


@decay_cases
def test_compiled_backward_within_budget_of_the_numpy_path(monkeypatch, B, H, T, Dk, Dv, chunk, decays, state,
                                                           units):
    decay_case(monkeypatch, jit.DECAY, _inputs(B, H, T, Dk, Dv, decays, state), B, H, chunk, units)


def test_a_decay_a_key_channel_and_float64_do_not_take_the_head_kernel(monkeypatch):
    mod = compiled_or_skip(jit.DECAY)
    calls = counted(monkeypatch, mod, "backward_chunks")
    q, k, v, g, S0, do, dS = _inputs(1, 2, 40, 8, 8, "mild", True)
    decay.backward(do, dS, q, k, v, g, scale=0.5, initial_state=S0)
    gc = np.repeat(g[..., None], 8, -1).astype(np.float32)
    f32 = [x.astype(np.float32) for x in (do, dS, q, k, v)]
    decay.backward(*f32, gc, scale=0.5, initial_state=S0.astype(np.float32))
    assert not calls


def test_the_compiled_backward_takes_its_own_chunk_where_the_caller_gives_none(monkeypatch):
    """Chunks of BACKWARD_CHUNK for the compiled pass (each of its products one OpenBLAS's small-matrix
    kernels take), the forward's where it does not run, the caller's where given; the gradients the
    same function of the inputs either way (within the oracle budget of test_compiled_backward_...)."""
    from qkv.recurrent.decay import fused
    mod = compiled_or_skip(jit.DECAY)
    seen = []
    real = mod.backward_chunks
    monkeypatch.setattr(mod, "backward_chunks", lambda *a: seen.append(a[1].shape[2]) or real(*a))
    q, k, v, g, S0, do, dS = (x.astype(np.float32) for x in _inputs(1, 2, 200, 96, 80, "mild", True))
    own = decay.backward(do, dS, q, k, v, g, scale=0.5, initial_state=S0)
    assert seen == [fused.BACKWARD_CHUNK] and fused.BACKWARD_CHUNK != decay._chunk_size(None, 200, 96)
    given = decay.backward(do, dS, q, k, v, g, scale=0.5, initial_state=S0, chunk=64)
    assert seen[-1] == 64
    for a, b in zip(own, given):                                   # two chunkings, one function
        assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()
    assert fused.backward_chunk(np.float64, True, 96, 80) is None                # the NumPy paths: the forward's
    assert fused.backward_chunk(np.float32, False, 96, 80) is None
