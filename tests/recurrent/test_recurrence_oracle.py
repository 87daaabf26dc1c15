"""The float64 step oracle (qkv.recurrent.steps): its backwards against central finite
differences, and its forwards against the recurrences written out by hand."""
import numpy as np
import pytest

from qkv.recurrent.decay import naive as decay_naive
from qkv.recurrent.delta import naive as delta_naive
from qkv.recurrent.generalized_delta import naive as dplr_naive
from qkv.recurrent.scan import naive as scan_naive

B, H, T, DK, DV = 2, 2, 5, 3, 4


def _numeric(loss, xs, i, eps=1e-6):
    x = xs[i]
    num = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + eps
        lp = loss(*xs)
        x[idx] = old - eps
        lm = loss(*xs)
        x[idx] = old
        num[idx] = (lp - lm) / (2 * eps)
    return num


def _check(forward, backward, args, n_grad):
    rng = np.random.default_rng(1)
    do, dS = rng.standard_normal((B, H, T, DV)), rng.standard_normal((B, H, DK, DV))

    def loss(*xs):
        o, S = forward(*xs)
        return (o * do).sum() + (S * dS).sum()

    grads = backward(do, dS, *args)
    for i in range(n_grad):
        if grads[i] is None:
            continue
        np.testing.assert_allclose(grads[i], _numeric(loss, list(args), i), atol=1e-7, err_msg=f"input {i}")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.mark.parametrize("per_channel", [False, True])
def test_decay_and_dplr_gradients(rng, per_channel):
    q, k, v = rng.standard_normal((B, H, T, DK)), rng.standard_normal((B, H, T, DK)), rng.standard_normal((B, H, T, DV))
    g = -np.abs(rng.standard_normal((B, H, T, DK) if per_channel else (B, H, T)))
    S0 = rng.standard_normal((B, H, DK, DV))
    kw = dict(scale=0.7)
    _check(lambda q, k, v, g, S0: decay_naive.decay_forward(q, k, v, g, initial_state=S0, **kw),
           lambda do, dS, q, k, v, g, S0: decay_naive.decay_backward(do, dS, q, k, v, g, initial_state=S0, **kw),
           [q, k, v, g, S0], 5)
    a, b = 0.3 * rng.standard_normal((B, H, T, DK)), 0.3 * rng.standard_normal((B, H, T, DK))
    _check(lambda q, k, v, a, b, g, S0: dplr_naive.dplr_forward(q, k, v, a, b, g, initial_state=S0, **kw),
           lambda do, dS, q, k, v, a, b, g, S0: dplr_naive.dplr_backward(do, dS, q, k, v, a, b, g, initial_state=S0, **kw),
           [q, k, v, a, b, g, S0], 7)


def test_delta_gradients(rng):
    q, k, v = rng.standard_normal((B, H, T, DK)), rng.standard_normal((B, H, T, DK)), rng.standard_normal((B, H, T, DV))
    beta, g = rng.uniform(0, 1, (B, H, T)), -np.abs(rng.standard_normal((B, H, T)))
    S0 = rng.standard_normal((B, H, DK, DV))
    _check(lambda q, k, v, beta, g, S0: delta_naive.delta_forward(q, k, v, beta, g, scale=0.7, initial_state=S0),
           lambda do, dS, q, k, v, beta, g, S0: delta_naive.delta_backward(do, dS, q, k, v, beta, g, scale=0.7, initial_state=S0),
           [q, k, v, beta, g, S0], 6)


def test_scan_gradients(rng):
    x, la, h0 = rng.standard_normal((B, T, DV)), -np.abs(rng.standard_normal((B, T, DV))), rng.standard_normal((B, DV))
    dh, dS = rng.standard_normal((B, T, DV)), rng.standard_normal((B, DV))

    def loss(x, la, h0):
        h, hT = scan_naive.scan_forward(x, la, initial_state=h0)
        return (h * dh).sum() + (hT * dS).sum()

    grads = scan_naive.scan_backward(dh, dS, x, la, initial_state=h0)
    for i in range(3):
        np.testing.assert_allclose(grads[i], _numeric(loss, [x, la, h0], i), atol=1e-7)


def test_forwards_by_hand(rng):
    """One head, written as the texts write the recurrences (matrices, one step at a time)."""
    q, k, v = rng.standard_normal((1, 1, T, DK)), rng.standard_normal((1, 1, T, DK)), rng.standard_normal((1, 1, T, DV))
    g, beta = -np.abs(rng.standard_normal((1, 1, T, DK))), rng.uniform(0, 1, (1, 1, T))
    a, b = rng.standard_normal((1, 1, T, DK)), rng.standard_normal((1, 1, T, DK))
    Sd, Sl, Sp = (np.zeros((DK, DV)) for _ in range(3))
    for t in range(T):
        qt, kt, vt = q[0, 0, t], k[0, 0, t], v[0, 0, t]
        Sd = np.diag(np.exp(g[0, 0, t])) @ Sd + np.outer(kt, vt)
        e = np.exp(g[0, 0, t, 0])
        Sl = e * (np.eye(DK) - beta[0, 0, t] * np.outer(kt, kt)) @ Sl + beta[0, 0, t] * np.outer(kt, vt)
        Sp = (np.diag(np.exp(g[0, 0, t])) + np.outer(b[0, 0, t], a[0, 0, t])) @ Sp + np.outer(kt, vt)
        np.testing.assert_allclose(decay_naive.decay_forward(q, k, v, g, scale=0.5)[0][0, 0, t], 0.5 * Sd.T @ qt, atol=1e-12)
        np.testing.assert_allclose(delta_naive.delta_forward(q, k, v, beta, g[..., 0], scale=0.5)[0][0, 0, t], 0.5 * Sl.T @ qt,
                                   atol=1e-12)
        np.testing.assert_allclose(dplr_naive.dplr_forward(q, k, v, a, b, g, scale=0.5)[0][0, 0, t], 0.5 * Sp.T @ qt, atol=1e-12)


def test_each_op_keeps_its_oracle_beside_its_chunked_form_and_the_old_names_work():
    """One folder an op (qkv.recurrent.<op>/): its chunked form and its step-loop oracle side by
    side; the oracles' old home ``qkv.kernels.recurrence`` still gives the same functions."""
    import importlib
    from pathlib import Path

    import qkv.recurrent as rec
    from qkv.kernels import recurrence as old

    root = Path(rec.__file__).parent
    for op, names in {"decay": ("decay_forward", "decay_backward"), "delta": ("delta_forward", "delta_backward"),
                      "generalized_delta": ("dplr_forward", "dplr_backward"),
                      "scan": ("scan_forward", "scan_backward")}.items():
        assert {"chunk.py", "naive.py"} <= {p.name for p in (root / op).glob("*.py")}, op
        naive = importlib.import_module(f"qkv.recurrent.{op}.naive")
        for name in names:
            assert getattr(old, name) is getattr(naive, name)
    assert callable(rec.dplr) and callable(rec.linear_scan)   # the public functions, not the folders
