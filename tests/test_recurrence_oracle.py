"""The float64 step oracle (qkv.kernels.recurrence): its backwards against central finite
differences, and its forwards against the recurrences written out by hand."""
import numpy as np
import pytest

from qkv.kernels import recurrence as R

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
    _check(lambda q, k, v, g, S0: R.decay_forward(q, k, v, g, initial_state=S0, **kw),
           lambda do, dS, q, k, v, g, S0: R.decay_backward(do, dS, q, k, v, g, initial_state=S0, **kw),
           [q, k, v, g, S0], 5)
    a, b = 0.3 * rng.standard_normal((B, H, T, DK)), 0.3 * rng.standard_normal((B, H, T, DK))
    _check(lambda q, k, v, a, b, g, S0: R.dplr_forward(q, k, v, a, b, g, initial_state=S0, **kw),
           lambda do, dS, q, k, v, a, b, g, S0: R.dplr_backward(do, dS, q, k, v, a, b, g, initial_state=S0, **kw),
           [q, k, v, a, b, g, S0], 7)


def test_delta_gradients(rng):
    q, k, v = rng.standard_normal((B, H, T, DK)), rng.standard_normal((B, H, T, DK)), rng.standard_normal((B, H, T, DV))
    beta, g = rng.uniform(0, 1, (B, H, T)), -np.abs(rng.standard_normal((B, H, T)))
    S0 = rng.standard_normal((B, H, DK, DV))
    _check(lambda q, k, v, beta, g, S0: R.delta_forward(q, k, v, beta, g, scale=0.7, initial_state=S0),
           lambda do, dS, q, k, v, beta, g, S0: R.delta_backward(do, dS, q, k, v, beta, g, scale=0.7, initial_state=S0),
           [q, k, v, beta, g, S0], 6)


def test_scan_gradients(rng):
    x, la, h0 = rng.standard_normal((B, T, DV)), -np.abs(rng.standard_normal((B, T, DV))), rng.standard_normal((B, DV))
    dh, dS = rng.standard_normal((B, T, DV)), rng.standard_normal((B, DV))

    def loss(x, la, h0):
        h, hT = R.scan_forward(x, la, initial_state=h0)
        return (h * dh).sum() + (hT * dS).sum()

    grads = R.scan_backward(dh, dS, x, la, initial_state=h0)
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
        np.testing.assert_allclose(R.decay_forward(q, k, v, g, scale=0.5)[0][0, 0, t], 0.5 * Sd.T @ qt, atol=1e-12)
        np.testing.assert_allclose(R.delta_forward(q, k, v, beta, g[..., 0], scale=0.5)[0][0, 0, t], 0.5 * Sl.T @ qt,
                                   atol=1e-12)
        np.testing.assert_allclose(R.dplr_forward(q, k, v, a, b, g, scale=0.5)[0][0, 0, t], 0.5 * Sp.T @ qt, atol=1e-12)
