"""Griffin's diagonal scan (qkv.recurrent.scan.chunk): the blocked scan and the step loop against the
float64 oracle, float32 within budget, and the public backward against finite differences."""
import numpy as np
import pytest

import qkv.recurrent as rec
from qkv.errors import ShapeError
from qkv.recurrent.scan import chunk as scan, naive as R


@pytest.fixture(params=["blocked", "steps"])
def path(request, monkeypatch):
    """Force one of the two paths (the width that switches between them)."""
    monkeypatch.setattr(scan, "BLOCKED_WIDTH", 10 ** 9 if request.param == "blocked" else 0)
    return request.param


def _inputs(rng, B, T, D, strong):
    x = rng.standard_normal((B, T, D))
    la = -rng.uniform(0, 1, (B, T, D))
    if strong:
        la = np.where(rng.uniform(0, 1, la.shape) < 0.3, -rng.uniform(0, 30, la.shape), la)
        la.flat[::5] = -30.0
    return x, la


@pytest.mark.parametrize("T", [0, 1, 5, 64, 100, 257, 1000])
def test_scan_equals_oracle_float64(path, T):
    rng = np.random.default_rng(T)
    for i, strong in enumerate((False, True, False, True)):
        x, la = _inputs(rng, 2, T, 7, strong)
        h0 = rng.standard_normal((2, 7)) if i < 2 else None
        ds = rng.standard_normal((2, 7)) if i % 2 else None
        h, hT = scan.forward(x, la, initial_state=h0)
        h_ref, hT_ref = R.scan_forward(x, la, initial_state=h0)
        np.testing.assert_allclose(h, h_ref, rtol=0, atol=1e-10)
        np.testing.assert_allclose(hT, hT_ref, rtol=0, atol=1e-10)
        dh = rng.standard_normal(x.shape)
        for got, ref in zip(scan.backward(dh, ds, x, la, initial_state=h0),
                            R.scan_backward(dh, ds, x, la, initial_state=h0)):
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-10)


def test_scan_float32_within_budget(path):
    """float32 within 2x the plain float32 loop's error against float64 (the blocked scan's
    extra rounding is one product and one add a step: measured about 1x)."""
    rng = np.random.default_rng(1)
    x, la = _inputs(rng, 2, 3000, 16, False)
    la *= 0.01                                                  # long memories: errors accumulate
    h_ref, _ = R.scan_forward(x, la)
    h, _ = scan.forward(x.astype(np.float32), la.astype(np.float32))
    a, state, plain = np.exp(la.astype(np.float32)), np.zeros((2, 16), np.float32), np.empty(x.shape, np.float32)
    for t in range(x.shape[1]):
        state = a[:, t] * state + x[:, t].astype(np.float32)
        plain[:, t] = state
    assert h.dtype == np.float32
    base = np.abs(plain - h_ref).max()
    assert np.abs(h - h_ref).max() <= 2 * base
    dx, _, _ = scan.backward(np.ones(x.shape, np.float32), None, x.astype(np.float32), la.astype(np.float32))
    dx_ref = R.scan_backward(np.ones(x.shape), None, x, la)[0]
    c, plain_dx = np.zeros((2, 16), np.float32), np.empty(x.shape, np.float32)
    for t in reversed(range(x.shape[1])):                       # the plain float32 reverse loop
        c = c + np.float32(1)
        plain_dx[:, t] = c
        c = a[:, t] * c
    assert dx.dtype == np.float32
    assert np.abs(dx - dx_ref).max() <= 2 * np.abs(plain_dx - dx_ref).max()


def test_public_scan_backward_finite_differences(path):
    rng = np.random.default_rng(2)
    x, la = _inputs(rng, 2, 9, 3, False)
    h0, dh, ds = rng.standard_normal((2, 3)), rng.standard_normal((2, 9, 3)), rng.standard_normal((2, 3))

    def loss(x, la, h0):
        h, hT = rec.linear_scan(x, la, initial_state=h0, return_state=True)
        return (h * dh).sum() + (hT * ds).sum()

    xs = [x, la, h0]
    grads = rec.linear_scan_backward(dh, x, la, initial_state=h0, dstate=ds)
    for i, name in enumerate(("x", "log_a", "initial_state")):
        num, v = np.zeros_like(xs[i]), xs[i]
        for idx in np.ndindex(v.shape):
            old = v[idx]
            v[idx] = old + 1e-6
            lp = loss(*xs)
            v[idx] = old - 1e-6
            lm = loss(*xs)
            v[idx] = old
            num[idx] = (lp - lm) / 2e-6
        np.testing.assert_allclose(grads[i], num, atol=1e-7, err_msg=name)


def test_public_scan_errors():
    x = np.zeros((2, 5, 3))
    with pytest.raises(ShapeError, match=r"log_a must have x's shape \(B, T, D\) = \(2, 5, 3\); got \(2, 5\)"):
        rec.linear_scan(x, np.zeros((2, 5)))
    with pytest.raises(ShapeError, match="log_a must be finite and <= 0"):
        rec.linear_scan(x, np.ones((2, 5, 3)))


def test_backward_arrays_have_forward_strides_at_every_length():
    """The backward runs the scan reversed in time; what it returns is laid out forward (a
    reversed length-1 axis counts as contiguous in NumPy, but torch.from_numpy refuses it)."""
    from qkv.recurrent import linear_scan_backward

    rng = np.random.default_rng(0)
    for T in (1, 2, 9):
        x, h0 = rng.standard_normal((2, T, 3)), rng.standard_normal((2, 3))
        for g in linear_scan_backward(x, x, -np.abs(x), initial_state=h0, dstate=h0):
            assert min(g.strides) >= 0 and g.flags.c_contiguous


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_step_loop_gives_numpys_bits(dtype, monkeypatch):
    """With the ``fast`` extra the step loop and its backward are one compiled pass each
    (``qkv.recurrent.scan.compiled``), rounding as NumPy's ufunc calls round: the same bits, with
    and without an initial state and a final state's gradient, decays down to exp(-30), signed
    zeros, T = 1 and odd T, strided inputs, float16 in (computed in float32)."""
    from qkv import jit
    if jit.load(jit.SCAN) is None:
        pytest.skip("numba is not installed (pip install -e '.[fast]') or QKV_JIT=0")
    monkeypatch.setattr(scan, "BLOCKED_WIDTH", 0)
    rng = np.random.default_rng(11)
    cases = []
    for T, strong, state in ((1, False, True), (37, True, False), (64, True, True), (129, False, False)):
        x, la = _inputs(rng, 3, T, 20, strong)
        x.flat[::7] = -0.0
        dh = rng.standard_normal(x.shape)
        dh.flat[::11] = -0.0
        h0 = rng.standard_normal((3, 20)) if state else None
        ds = rng.standard_normal((3, 20)) if state else None
        cases.append([z if z is None else z.astype(dtype) for z in (x, la, dh, h0, ds)])
    x, la, dh, h0, ds = cases[1]
    cases.append([x[:, ::-1], la[:, ::-1], dh.transpose(0, 1, 2)[:, ::-1], None, None])      # strided
    cases.append([z if z is None else z.astype(np.float16) for z in cases[0]])             # float16 in

    def run():
        out = []
        for x, la, dh, h0, ds in cases:
            out += [*scan.forward(x, la, initial_state=h0), *scan.backward(dh, ds, x, la, initial_state=h0)]
        return out

    compiled = run()
    monkeypatch.setitem(jit._loaded, jit.SCAN, None)
    plain = run()
    assert len(compiled) == len(plain) == 5 * len(cases)
    for got, want in zip(compiled, plain):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))
