"""The decay recurrence's compiled float32 backward with a decay a key channel (qkv.recurrent.decay.
channel_compiled: backward_states, then backward_chunks, driven by qkv.recurrent.decay.fused.backward_channels)
against the float64 step oracle, each gradient within a budget of the NumPy path's own float32 error: mild,
steep (-30 a step), none (g = 0) and mixed decays, channels of one head differing; T a multiple of the chunk
(the gradients written in place) and not; one work unit and one a head; with and without an initial state and
dstate."""
import numpy as np
import pytest

from compiled_budget import compiled_or_skip, counted, decay_case, decay_cases, rel
from qkv import jit
from qkv.recurrent.decay import chunk as decay, naive as recurrence



def _inputs(B, H, T, Dk, Dv, decays, state, seed=0):
    rng = np.random.default_rng(seed + T + Dk)
    q, k = rng.standard_normal((B, H, T, Dk)), rng.standard_normal((B, H, T, Dk))
    v, do = rng.standard_normal((B, H, T, Dv)), rng.standard_normal((B, H, T, Dv))
    shape = (B, H, T, Dk)
    g = {"mild": -np.logaddexp(0, rng.standard_normal(shape) - 1).clip(0, 1.5), "steep": np.full(shape, -30.0),
         "none": np.zeros(shape), "mixed": -rng.uniform(0, 1, shape)}[decays]
    if decays == "mixed":
        g[rng.uniform(size=shape) < 0.15] = -30.0                  # some steps of some channels forget almost all
        g[rng.uniform(size=shape) < 0.15] = 0.0                    # some none
        g[..., : Dk // 4] = 0.0                                    # a quarter of the channels never decay
    S0, dS = (rng.standard_normal((B, H, Dk, Dv)) if state else None for _ in range(2))
    return q, k, v, g, S0, do, dS


@decay_cases
def test_compiled_backward_within_budget_of_the_numpy_path(monkeypatch, B, H, T, Dk, Dv, chunk, decays, state,
                                                           units):
    decay_case(monkeypatch, jit.DECAY_CHANNELS, _inputs(B, H, T, Dk, Dv, decays, state), B, H, chunk, units)


def test_steep_decays_keep_their_tiny_gradients():
    """At -30 a step every in-chunk pair's factor is below exp(-30): dg's share of them is as tiny as they are,
    not what is left of undecayed terms that cancel (judged per channel against the oracle's largest entry of
    that channel's steep steps)."""
    compiled_or_skip(jit.DECAY_CHANNELS)
    q, k, v, g, S0, do, dS = _inputs(1, 1, 64, 8, 8, "steep", False)
    g[..., ::2] = -1.0                                             # even channels mild, odd channels steep
    want = recurrence.decay_backward(do, dS, q, k, v, g, scale=0.7, initial_state=S0)[3]
    got = decay.backward(*(x.astype(np.float32) for x in (do,)), None,
                         *(x.astype(np.float32) for x in (q, k, v, g)), scale=0.7)[3]
    for d in range(1, 8, 2):
        assert rel(got[..., 1:, d], want[..., 1:, d]) < 1e-5, d


def test_float64_and_chunks_of_one_keep_the_numpy_path(monkeypatch):
    mod = compiled_or_skip(jit.DECAY_CHANNELS)
    calls = counted(monkeypatch, mod, "backward_chunks")
    q, k, v, g, S0, do, dS = _inputs(1, 2, 40, 8, 8, "mild", True)
    decay.backward(do, dS, q, k, v, g, scale=0.5, initial_state=S0)
    f32 = [x.astype(np.float32) for x in (do, dS, q, k, v, g)]
    decay.backward(*f32, scale=0.5, initial_state=S0.astype(np.float32), chunk=1)
    assert not calls
    decay.backward(*f32, scale=0.5, initial_state=S0.astype(np.float32))
    assert calls
