"""qkv.positional: the sinusoidal formula, RoPE's relative property and its backward, ALiBi slopes."""
import math

import numpy as np
import pytest

import qkv
from qkv.positional import alibi_slopes, rope, rope_angles, rope_backward, sinusoidal


def test_sinusoidal_matches_the_formula_entry_by_entry():
    n, d = 50, 16
    table = sinusoidal(n, d, dtype=np.float64)
    for pos in range(n):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert table[pos, 2 * i] == pytest.approx(math.sin(angle), abs=1e-12)
            assert table[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-12)
    assert sinusoidal(4, 8).dtype == np.float32


def test_sinusoidal_odd_width_ends_on_a_sine():
    table = sinusoidal(6, 5, dtype=np.float64)
    assert table.shape == (6, 5)
    assert table[3, 4] == pytest.approx(math.sin(3 / 10000 ** (4 / 5)))


@pytest.mark.parametrize("d", [2, 8, 64])
def test_rope_scores_depend_only_on_the_offset_i_minus_j(d):
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, d)), rng.standard_normal((1, d))

    def score(i, j):
        return float((rope(q, positions=np.array([i])) @ rope(k, positions=np.array([j])).T)[0, 0])

    for delta in (0, 1, 5, -3):
        ref = score(10 + delta, 10)
        for i in (3, 17, 250, 4000):
            if i - delta >= 0:
                assert score(i, i - delta) == pytest.approx(ref, rel=1e-9, abs=1e-9)
    assert abs(score(7, 0) - score(0, 0)) > 1e-6  # but it does depend on the offset


def test_rope_half_split_pairs_feature_i_with_i_plus_half():
    d, pos = 8, 3
    x = np.zeros((1, d))
    x[0, 1] = 1.0  # feature 1 pairs with feature 1 + d/2 = 5
    y = rope(x, positions=np.array([pos]))
    theta = 10000 ** (-2 * 1 / d)
    expect = np.zeros(d)
    expect[1], expect[5] = math.cos(pos * theta), math.sin(pos * theta)
    np.testing.assert_allclose(y[0], expect, atol=1e-12)


def test_rope_offset_equals_positions_and_keeps_norms():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 5, 6))
    np.testing.assert_allclose(rope(x, offset=7), rope(x, positions=np.arange(7, 12)))
    np.testing.assert_allclose(np.linalg.norm(rope(x, offset=3), axis=-1), np.linalg.norm(x, axis=-1))
    assert rope(x.astype(np.float32)).dtype == np.float32


def test_rope_backward_is_the_inverse_rotation_and_the_true_gradient():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 6))
    np.testing.assert_allclose(rope_backward(rope(x, offset=5), offset=5), x, atol=1e-12)
    r = rng.standard_normal((4, 6))
    dx = rope_backward(r, offset=5)
    eps = 1e-6
    for idx in [(0, 0), (1, 4), (3, 2), (2, 5)]:
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        numeric = (np.sum(rope(xp, offset=5) * r) - np.sum(rope(xm, offset=5) * r)) / (2 * eps)
        assert numeric == pytest.approx(dx[idx], abs=1e-8)


def test_rope_angles_shape_and_bad_inputs():
    cos, sin = rope_angles(np.arange(4), 8)
    assert cos.shape == sin.shape == (4, 4)
    with pytest.raises(qkv.ShapeError, match="even"):
        rope(np.zeros((3, 5)))
    with pytest.raises(qkv.ShapeError, match="positions"):
        rope(np.zeros((3, 4)), positions=np.arange(2))
    with pytest.raises(qkv.ShapeError, match="offset"):
        rope(np.zeros((3, 4)), offset=-1)
    with pytest.raises(qkv.ShapeError, match="x must have at least 2"):
        rope(np.zeros(4))
    with pytest.raises(qkv.ShapeError, match=r"positions= or offset=, not both .* offset=3"):
        rope(np.zeros((3, 4)), positions=np.arange(3), offset=3)  # was: offset silently ignored


def test_alibi_slopes_for_8_heads_are_the_papers():
    np.testing.assert_allclose(alibi_slopes(8), [2.0 ** -(i + 1) for i in range(8)])


def test_alibi_slopes_for_a_non_power_of_two():
    # Press et al.: the 8 slopes of 8 heads, then every other slope of 16 heads (2^-0.5, 2^-1.5, ...).
    expect = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(0.5 + i) for i in range(4)]
    np.testing.assert_allclose(alibi_slopes(12), expect)
    np.testing.assert_allclose(alibi_slopes(6), [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125])
    np.testing.assert_allclose(alibi_slopes(1), [2.0 ** -8])
    with pytest.raises(qkv.ShapeError, match="n_heads"):
        alibi_slopes(0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rope_compiled_pass_gives_numpys_bits(dtype, monkeypatch):
    """With the ``fast`` extra RoPE is one compiled pass (``qkv.kernels.rope_compiled``); it rounds
    as NumPy's six ufunc calls do, so both paths give the same bits: contiguous and strided
    inputs (the heads of a ``(B, T, H, D)`` projection), offsets, positions, a ragged batch's
    offsets, the backward's inverse rotation, long positions and large magnitudes."""
    from qkv import jit
    if jit.load(jit.ROPE) is None:
        pytest.skip("numba is not installed (pip install -e '.[fast]') or QKV_JIT=0")
    rng = np.random.default_rng(5)
    proj = (30 * rng.standard_normal((3, 17, 4, 16))).astype(dtype)            # (B, T, H, D)
    heads = proj.transpose(0, 2, 1, 3)                                         # (B, H, T, D), strided
    cases = [lambda f, x: f(x), lambda f, x: f(x, offset=100000),
             lambda f, x: f(x, positions=rng_pos), lambda f, x: f(x, offset=np.array([0, 5, 3])),
             lambda f, x: f(x[0, 0]), lambda f, x: f(x, base=500.0)]
    rng_pos = np.random.default_rng(6).integers(0, 1 << 20, 17)
    compiled = [[case(f, x) for case in cases for f in (rope, rope_backward)] for x in (heads, heads.copy())]
    monkeypatch.setitem(jit._loaded, jit.ROPE, None)
    plain = [[case(f, x) for case in cases for f in (rope, rope_backward)] for x in (heads, heads.copy())]
    for got_set, want_set in zip(compiled, plain):
        for got, want in zip(got_set, want_set):
            assert got.dtype == dtype and got.shape == want.shape and np.array_equal(got, want)
    half = rope(heads.astype(np.float16))                                     # float16: NumPy's path, float16 out
    assert half.dtype == np.float16
