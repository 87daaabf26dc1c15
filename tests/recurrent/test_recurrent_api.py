"""The checked entry points of qkv.recurrent as a whole: what every op does at T = 0, which
values each refuses (and that the refusal names the value), and the dtypes they return."""
from __future__ import annotations

import numpy as np
import pytest

import qkv.recurrent as rec
from qkv.errors import ShapeError

B, H, DK, DV = 2, 3, 4, 5


def _inputs(T: int, rng, B=B, H=H, DK=DK, DV=DV) -> dict:
    n = lambda *s: rng.standard_normal(s)  # noqa: E731
    return dict(q=n(B, H, T, DK), k=n(B, H, T, DK), v=n(B, H, T, DV), dout=n(B, H, T, DV),
                g_head=-np.abs(n(B, H, T)), g_chan=-np.abs(n(B, H, T, DK)), beta=np.full((B, H, T), 0.5),
                a=n(B, H, T, DK), b=n(B, H, T, DK))


# (name, forward(x, state), backward(x, state, dstate)), one for each op and decay layout
OPS = [
    ("decay head", lambda x, s: rec.decay_attention(x["q"], x["k"], x["v"], x["g_head"], initial_state=s,
                                                    return_state=True),
     lambda x, s, d: rec.decay_attention_backward(x["dout"], x["q"], x["k"], x["v"], x["g_head"],
                                                  initial_state=s, dstate=d)),
    ("decay channel", lambda x, s: rec.decay_attention(x["q"], x["k"], x["v"], x["g_chan"], initial_state=s,
                                                       return_state=True),
     lambda x, s, d: rec.decay_attention_backward(x["dout"], x["q"], x["k"], x["v"], x["g_chan"],
                                                  initial_state=s, dstate=d)),
    ("delta", lambda x, s: rec.delta_rule(x["q"], x["k"], x["v"], x["beta"], x["g_head"], initial_state=s,
                                          return_state=True),
     lambda x, s, d: rec.delta_rule_backward(x["dout"], x["q"], x["k"], x["v"], x["beta"], x["g_head"],
                                             initial_state=s, dstate=d)),
    ("dplr", lambda x, s: rec.dplr(x["q"], x["k"], x["v"], x["a"], x["b"], x["g_chan"], initial_state=s,
                                   return_state=True),
     lambda x, s, d: rec.dplr_backward(x["dout"], x["q"], x["k"], x["v"], x["a"], x["b"], x["g_chan"],
                                       initial_state=s, dstate=d)),
]


@pytest.mark.parametrize("given", [True, False], ids=["state", "no state"])
@pytest.mark.parametrize("name, fwd, bwd", OPS, ids=[o[0] for o in OPS])
def test_an_empty_sequence_gives_the_empty_result(name, fwd, bwd, given):
    """T = 0: o is (B, H, 0, Dv), S_T is S_0 (zeros without one), the per-step gradients are
    empty and dS_0 = dstate: no step between them (as torch's autograd of an empty loop)."""
    rng = np.random.default_rng(0)
    x = _inputs(0, rng)
    S0 = rng.standard_normal((B, H, DK, DV)) if given else None
    dS = rng.standard_normal((B, H, DK, DV))
    o, S = fwd(x, S0)
    assert o.shape == (B, H, 0, DV) and o.dtype == np.float64
    assert np.array_equal(S, S0 if given else np.zeros((B, H, DK, DV)))
    if given:
        assert S is not S0                                    # a copy: the caller's array is not aliased
    grads = bwd(x, S0, dS)
    assert all(g.size == 0 for g in grads[:-1])
    assert np.array_equal(grads[-1], dS) if given else grads[-1] is None


def test_an_empty_scan_gives_the_empty_result():
    h0, dh0 = np.arange(6.0).reshape(2, 3), np.ones((2, 3))
    x = np.zeros((2, 0, 3))
    h, hT = rec.linear_scan(x, x, initial_state=h0, return_state=True)
    assert h.shape == (2, 0, 3) and np.array_equal(hT, h0)
    dx, dla, d0 = rec.linear_scan_backward(x, x, x, initial_state=h0, dstate=dh0)
    assert dx.shape == dla.shape == (2, 0, 3) and np.array_equal(d0, dh0)


@pytest.mark.parametrize("axis", ["B", "H", "Dv"])
@pytest.mark.parametrize("name, fwd, bwd", OPS, ids=[o[0] for o in OPS])
def test_an_empty_batch_head_or_value_axis_gives_the_empty_result(name, fwd, bwd, axis):
    """B, H or Dv = 0 with T steps: nothing to carry, so o and S_T have their (empty) shapes
    and every gradient its input's shape, zero (they raised NumPy's bare reshape error)."""
    dims = dict(B=B, H=H, DK=DK, DV=DV) | {"DV" if axis == "Dv" else axis: 0}
    rng = np.random.default_rng(2)
    x = _inputs(6, rng, **dims)
    S0 = rng.standard_normal((dims["B"], dims["H"], DK, dims["DV"]))
    o, S = fwd(x, S0)
    assert o.shape == (dims["B"], dims["H"], 6, dims["DV"]) and S.shape == S0.shape and S.size == 0
    grads = bwd(x, S0, S0)
    inputs = [x["q"], x["k"], x["v"]] + ([x["beta"]] if name == "delta" else []) \
        + ([x["a"], x["b"]] if name == "dplr" else []) + [x["g_chan" if "chan" in name or name == "dplr" else "g_head"], S0]
    assert [g.shape for g in grads] == [i.shape for i in inputs]
    assert not any(np.any(g) for g in grads)


@pytest.mark.parametrize("name, fwd, bwd", OPS, ids=[o[0] for o in OPS])
def test_no_key_channel_is_refused_by_name(name, fwd, bwd):
    """Dk = 0 has no default scale (1/sqrt(0)): a ShapeError naming q and k, not a ZeroDivisionError."""
    x = _inputs(4, np.random.default_rng(3), DK=0)
    for call in (lambda: fwd(x, None), lambda: bwd(x, None, None)):
        with pytest.raises(ShapeError, match=r"q and k must have Dk >= 1 .*got q \(2, 3, 4, 0\)"):
            call()


@pytest.mark.parametrize("shape", [(0, 5, 3), (2, 5, 0)])
def test_a_scan_with_no_channel_gives_the_empty_result(shape):
    x = np.zeros(shape)
    h, hT = rec.linear_scan(x, x, return_state=True)
    assert h.shape == shape and hT.shape == (shape[0], shape[2])
    dx, dla, d0 = rec.linear_scan_backward(x, x, x)
    assert dx.shape == dla.shape == shape and d0 is None


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_delta_rule_refuses_a_beta_that_is_not_finite(bad):
    """A NaN beta made every output NaN; it is refused by name as log_decay is."""
    x = _inputs(4, np.random.default_rng(1))
    beta = x["beta"].copy()
    beta[1, 2, 3] = bad
    for call in (lambda: rec.delta_rule(x["q"], x["k"], x["v"], beta),
                 lambda: rec.delta_rule_backward(x["dout"], x["q"], x["k"], x["v"], beta)):
        with pytest.raises(ShapeError, match=f"beta must be finite .*; got {bad}"):
            call()


@pytest.mark.parametrize("bad", [0.5, np.nan, np.inf])
def test_linear_scan_names_the_log_a_it_refuses(bad):
    x = np.zeros((2, 5, 3))
    log_a = -np.ones((2, 5, 3))
    log_a[1, 4, 2] = bad
    with pytest.raises(ShapeError, match=f"log_a must be finite and <= 0 .*; got {bad}"):
        rec.linear_scan(x, log_a)
    with pytest.raises(ShapeError, match=f"log_a must be finite and <= 0 .*; got {bad}"):
        rec.linear_scan_backward(x, x, log_a)


def test_float16_computes_in_float32_and_returns_a_float32_state_in_every_op():
    """The outputs come back in the inputs' dtype, the state in the compute dtype, for all ops."""
    rng = np.random.default_rng(2)
    x16 = {k: v.astype(np.float16) for k, v in _inputs(6, rng).items()}
    for name, fwd, _ in OPS:
        o, S = fwd(x16, None)
        assert (o.dtype, S.dtype) == (np.float16, np.float32), name
    xs, la = rng.standard_normal((2, 6, 3)), -np.abs(rng.standard_normal((2, 6, 3)))
    h, hT = rec.linear_scan(xs.astype(np.float16), la.astype(np.float16), return_state=True)
    assert (h.dtype, hT.dtype) == (np.float16, np.float32)
    ref = rec.linear_scan(xs.astype(np.float16).astype(np.float64), la.astype(np.float16).astype(np.float64))
    assert np.max(np.abs(h - ref)) <= 2 * np.max(np.abs(ref)) * np.finfo(np.float16).eps
    grads = rec.linear_scan_backward(h, xs.astype(np.float16), la.astype(np.float16),
                                     initial_state=np.zeros((2, 3), np.float16))
    assert [g.dtype for g in grads] == [np.float16] * 3
