"""A NaN (or an inf) reaches exactly what the recurrence carries it to: forwards, the outputs
of its step and later steps and the state; backwards, the gradients the step loop makes NaN,
and no others. A chunk's products mix rows before the causal mask zeroes the ones a row may
not see (``0 · NaN = NaN``), so a chunked kernel used to spread a NaN in ``k_10`` to rows 0-9
of its chunk; qkv runs such calls in chunks of one step. Judged against the float64 step loops
(each op's ``naive.py``), for every input that carries values, both dtypes, chunk sizes."""
import numpy as np
import pytest

import qkv.recurrent as rec
from qkv.recurrent.decay import naive as decay_naive
from qkv.recurrent.delta import naive as delta_naive
from qkv.recurrent.scan import naive as scan_naive

B, H, T, D = 1, 2, 16, 4


def steps_hit(x) -> list:
    """The steps (axis 2, or 1 for the scan's (B, T, D)) holding a non-finite entry."""
    x = np.asarray(x)
    axis = 1 if x.ndim == 3 else 2
    return np.flatnonzero(~np.isfinite(np.moveaxis(x, axis, 0).reshape(x.shape[axis], -1)).all(1)).tolist()


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((B, H, T, D)) for _ in range(4))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return dict(q=q, k=k, v=v, do=do, beta=rng.uniform(0.1, 0.9, (B, H, T)),
                g_head=-rng.uniform(0, 1, (B, H, T)), g_chan=-rng.uniform(0, 1, (B, H, T, D)),
                S0=rng.standard_normal((B, H, D, D)))


def same_reach(got, want, names):
    for name, a, b in zip(names, got, want):
        assert steps_hit(a) == steps_hit(b), name


@pytest.mark.parametrize("bad", ["q", "k", "v", "do"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("chunk", [None, 4, 1])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("decay", ["g_head", "g_chan"])
def test_decay_attention_nan_reaches_what_the_steps_carry_it_to(bad, value, chunk, dtype, decay):
    x = inputs()
    x[bad][:, :, 10] = value
    q, k, v, g, do = x["q"], x["k"], x["v"], x[decay], x["do"]
    with np.errstate(all="ignore"):                  # the oracle's inf - inf (qkv's calls must not warn)
        want = decay_naive.decay_forward(q, k, v, g, scale=0.5)[:1] + decay_naive.decay_backward(do, None, q, k, v, g, scale=0.5)[:4]
    c = [a.astype(dtype) for a in (q, k, v, g)]
    got = (rec.decay_attention(*c, scale=0.5, chunk_size=chunk),) + \
        rec.decay_attention_backward(do.astype(dtype), *c, scale=0.5, chunk_size=chunk)[:4]
    same_reach(got, want, ["o", "dq", "dk", "dv", "dg"])


@pytest.mark.parametrize("bad", ["q", "k", "v", "do", "S0"])
@pytest.mark.parametrize("chunk", [None, 4])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("gated", [False, True])
def test_delta_rule_nan_reaches_what_the_steps_carry_it_to(bad, chunk, dtype, gated):
    x = inputs(1)
    if bad == "S0":
        x["S0"][0, 1, 2, 3] = np.nan
    else:
        x[bad][:, :, 10] = np.nan
    q, k, v, beta, do, S0 = x["q"], x["k"], x["v"], x["beta"], x["do"], x["S0"]
    g = x["g_head"] if gated else None
    want = (delta_naive.delta_forward(q, k, v, beta, g, scale=0.5, initial_state=S0)[:1]
            + delta_naive.delta_backward(do, None, q, k, v, beta, g, scale=0.5, initial_state=S0)[:4])
    c = [None if a is None else a.astype(dtype) for a in (q, k, v, beta, g)]
    got = (rec.delta_rule(*c, scale=0.5, initial_state=S0.astype(dtype), chunk_size=chunk),) + \
        rec.delta_rule_backward(do.astype(dtype), *c, scale=0.5, initial_state=S0.astype(dtype), chunk_size=chunk)[:4]
    same_reach(got, want, ["o", "dq", "dk", "dv", "dbeta"])


@pytest.mark.parametrize("width", [8, 600])     # the blocked scan and the step loop of wide states
def test_linear_scan_nan_reaches_what_the_steps_carry_it_to(width):
    rng = np.random.default_rng(2)
    x, dh = rng.standard_normal((2, 50, width)), rng.standard_normal((2, 50, width))
    log_a = -rng.random((2, 50, width))
    x[:, 20, 3] = np.nan
    want = scan_naive.scan_forward(x, log_a)[:1] + scan_naive.scan_backward(dh, None, x, log_a)[:2]
    got = (rec.linear_scan(x, log_a),) + rec.linear_scan_backward(dh, x, log_a)[:2]
    same_reach(got, want, ["h", "dx", "dlog_a"])


def test_finite_inputs_keep_their_chunk_and_their_bits():
    """The check for non-finite inputs changes nothing where there are none."""
    from qkv.recurrent.decay import chunk as decay
    x = inputs(3)
    args = (x["q"], x["k"], x["v"], x["g_head"])
    assert np.array_equal(rec.decay_attention(*args, scale=0.5, chunk_size=4),
                          decay.forward(*args, scale=0.5, chunk=4)[0])


@pytest.mark.parametrize("bad", ["q", "k", "v", "a", "b", "do"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("per_channel", [False, True])
def test_dplr_nan_reaches_what_the_steps_carry_it_to(bad, dtype, per_channel):
    """dplr's chunked form spreads a NaN even in chunks of one step (its transition and write
    meet in one product: a NaN key reached da of its own step); such calls run step by step."""
    from qkv.recurrent.generalized_delta import naive as dplr_naive
    rng = np.random.default_rng(4)
    x = {n: 0.5 * rng.standard_normal((B, H, 70, D)) for n in ("q", "k", "v", "a", "b", "do")}
    g = -rng.uniform(0, 1, (B, H, 70, D) if per_channel else (B, H, 70))
    x[bad][:, :, 66] = np.nan                     # the second segment of the stepwise path
    args = [x[n] for n in ("q", "k", "v", "a", "b")] + [g]
    with np.errstate(all="ignore"):
        want = (dplr_naive.dplr_forward(*args, scale=0.5)[:1]
                + dplr_naive.dplr_backward(x["do"], None, *args, scale=0.5)[:6])
    c = [a.astype(dtype) for a in args]
    got = (rec.dplr(*c, scale=0.5),) + rec.dplr_backward(x["do"].astype(dtype), *c, scale=0.5)[:6]
    same_reach(got, want, ["o", "dq", "dk", "dv", "da", "db", "dg"])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_finite_check_answers_as_the_entries_do(dtype):
    """The check's one-pass Σx² says "finite" only where every entry is; where the sum is not
    (a NaN, an inf, or finite entries large enough to overflow it) or BLAS cannot take the
    array (a strided view), the min and max decide: huge finite inputs keep the chunked path."""
    from qkv.recurrent.checked import _not_finite

    big = np.full((2, 3, 5), np.finfo(dtype).max / 2, dtype)        # Σx² overflows, every entry finite
    assert not _not_finite(big, big[:, :, ::2], np.ones(4, dtype), None)
    for value in (np.nan, np.inf, -np.inf):
        for x in (big.copy(), np.zeros((2, 3, 5), dtype)):
            x[1, 2, 3] = value
            assert _not_finite(x) and _not_finite(x[:, :, 1::2]) and _not_finite(np.ones(3, dtype), x)
