"""One decay a head, each chunk of a head its own kind (qkv.recurrent.decay.intra.HeadDecay): a slab
whose chunks mix mild decays (the rank-one factors) with steep ones past LIMIT (the (C, C) exps)
gathers each kind, takes its products and puts them back. Against the float64 step oracle
(float64: 1e-10 of each array's largest true entry; float32: twice the float32 step loop's error),
forward and backward, the NumPy path and the compiled forward, with the split checked to happen;
and each head's bits are those it gets alone (a chunk's kind depends on its own decays only)."""
import numpy as np
import pytest

from compiled_budget import counted
from qkv import jit
from qkv.recurrent.decay import chunk as decay, intra as decay_intra, naive as R

DK, DV = 6, 5
NAMES = ["o", "S_T", "dq", "dk", "dv", "dg", "dS0"]


def mixed_problem(rng, T, dtype=np.float64):
    """q, k, v, g, S0, dout, dstate for 4 heads: mild; -30 a step; mild with a burst of -30 (steps
    40-59) and a reset (-1e4 at step 90); mild with a fifth of its first third at -30 or -1e4."""
    q, k = (rng.standard_normal((1, 4, T, DK)) for _ in range(2))
    v, do = (rng.standard_normal((1, 4, T, DV)) for _ in range(2))
    g = -0.3 * rng.random((1, 4, T)) ** 3
    g[0, 1] = -30.0
    g[0, 2, 40:60] = -30.0
    g[0, 2, 90] = -1e4
    hit = rng.random(T // 3) < 0.2
    g[0, 3, :T // 3][hit] = rng.choice([-30.0, -1e4], size=int(hit.sum()))
    S0, dS = (rng.standard_normal((1, 4, DK, DV)) for _ in range(2))
    return [x.astype(dtype) for x in (q, k, v, g, S0, do, dS)]


def run(x, chunk):
    q, k, v, g, S0, do, dS = x
    o, S = decay.forward(q, k, v, g, scale=0.5, initial_state=S0, chunk=chunk)
    return (o, S) + tuple(decay.backward(do, dS, q, k, v, g, scale=0.5, initial_state=S0, chunk=chunk))


def oracle(x, dtype=np.float64):
    q, k, v, g, S0, do, dS = x
    o, S = R.decay_forward(q, k, v, g, scale=0.5, initial_state=S0, dtype=dtype)
    return (o, S) + tuple(R.decay_backward(do, dS, q, k, v, g, scale=0.5, initial_state=S0, dtype=dtype))


def rel_to_top(x, ref):
    return float(np.abs(np.asarray(x, np.float64) - ref).max() / np.abs(ref).max())


def split_seen(monkeypatch) -> list:
    """The HeadDecays made from now on whose slab mixes both kinds of chunk (``steep`` set)."""
    seen, real = [], decay_intra.HeadDecay.__init__

    def init(self, G, dtype):
        real(self, G, dtype)
        if self.steep is not None:
            seen.append((int(self.steep.sum()), int((~self.steep).sum())))
    monkeypatch.setattr(decay_intra.HeadDecay, "__init__", init)
    return seen


@pytest.mark.parametrize("T, chunk", [(150, 16), (150, 32), (97, None), (128, 16)])
def test_mixed_slabs_float64_every_gradient_to_1e_10(monkeypatch, T, chunk):
    """Heads of every kind in one slab (and one head's chunks of both kinds), T a multiple of the
    chunk and not, an initial state and dstate: each output and gradient within 1e-10 of its largest
    true entry (the steep decays' test's budget), and the slabs did mix."""
    x = mixed_problem(np.random.default_rng(T + (chunk or 0)), T)
    seen = split_seen(monkeypatch)
    got = run(x, chunk)
    assert seen and all(steep and mild for steep, mild in seen), "no slab took both paths"
    for name, a, b in zip(NAMES, got, oracle(x)):
        assert a.dtype == np.float64 and rel_to_top(a, b) <= 1e-10, (name, rel_to_top(a, b))


@pytest.mark.parametrize("path", ["numpy", "compiled"])
@pytest.mark.parametrize("T, chunk", [(150, 16), (97, None)])
def test_mixed_slabs_float32_within_a_budget_of_the_float32_step_loop(monkeypatch, path, T, chunk):
    """float32: each output and gradient's error (against its largest true entry) at most twice the
    float32 step loop's; the NumPy path (the compiled module off) and the compiled forward, whose
    ``mode`` marks each head's chunks: both kinds, and a head with both."""
    x = mixed_problem(np.random.default_rng(7 * T), T)
    x32 = [a.astype(np.float32) for a in x]
    x32[3] = np.maximum(x[3], np.finfo(np.float32).min).astype(np.float32)
    modes = []
    if path == "numpy":
        monkeypatch.setitem(jit._loaded, jit.DECAY, None)
        seen = split_seen(monkeypatch)
    else:
        mod = jit.load(jit.DECAY)
        if mod is None or not mod.SGEMM:
            pytest.skip("numba (the fast extra) with a BLAS sgemm is not available, or QKV_JIT=0")
        for name in ("forward_merged", "forward_chunks"):
            real = getattr(mod, name)
            monkeypatch.setattr(mod, name, lambda *a, real=real: modes.append(a[9].copy()) or real(*a))
    got = run(x32, chunk)
    if path == "numpy":
        assert seen and all(steep and mild for steep, mild in seen), "no slab took both paths"
    else:
        assert modes, "the compiled forward did not run"
        mode = np.concatenate(modes)
        assert mode.min() == 0 and mode.max() == 1 and any(0 < r.sum() < r.size for r in mode)
    want, steps = oracle(x), oracle(x32, np.float32)
    floor = 2 * np.finfo(np.float32).eps
    for name, a, s, w in zip(NAMES, got, steps, want):
        assert a.dtype == np.float32 and np.isfinite(a).all(), name
        assert rel_to_top(a, w) <= 2.0 * max(rel_to_top(s, w), floor), (name, rel_to_top(a, w), rel_to_top(s, w))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("compiled", [True, False], ids=["jit", "numpy"])
def test_each_head_gets_the_bits_it_gets_alone(monkeypatch, dtype, compiled):
    """A chunk's kind is its own decays' alone: each head of a mixed call gives, bit for bit, what it
    gives run by itself (in a slab of its own kind, or of its own chunks); slabs of 32 rows so that
    a call holds several."""
    if not compiled:
        monkeypatch.setitem(jit._loaded, jit.DECAY, None)
    monkeypatch.setattr(decay, "SLAB_ROWS", 32)
    x = mixed_problem(np.random.default_rng(3), 150, dtype)
    together = run(x, 16)
    for h in range(4):
        alone = run([a[:, h:h + 1] for a in x], 16)
        for name, a, b in zip(NAMES, together, alone):
            np.testing.assert_array_equal(a[:, h:h + 1], b, err_msg=f"head {h}: {name}")


def test_a_slab_of_one_kind_is_not_split():
    """A slab whose chunks are all mild, or all steep, takes one path on the whole slab."""
    G = np.cumsum(np.full((2, 3, 8, 1), -1.0), axis=2)                  # Γ = -8: all factored
    mild = decay_intra.HeadDecay(G, np.float64)
    steep = decay_intra.HeadDecay(4 * G, np.float64)                     # Γ = -32: all masked
    steep_D = steep.D.copy()                                             # (a work array: the next mask's)
    mixed = decay_intra.HeadDecay(np.where(np.arange(3)[:, None, None] == 1, 4 * G, G), np.float64)
    assert mild.factored and mild.steep is None and steep.steep is None and not steep.factored
    assert not mixed.factored and mixed.steep.tolist() == [[False, True, False]] * 2
    e_gam, D = np.zeros((2, 3)), np.zeros((2, 3, 8, 8))
    assert mixed.chunks(e_gam, D).tolist() == [[True, False, True]] * 2
    np.testing.assert_array_equal(e_gam[:, 1], 0)
    np.testing.assert_array_equal(D[:, [0, 2]], 0)
    np.testing.assert_array_equal(D[:, 1], steep_D[:, 1])
    np.testing.assert_array_equal(e_gam[:, [0, 2]], mild.e_gam[:, [0, 2], 0, 0])


@pytest.mark.parametrize("path", ["numpy", "compiled"])
@pytest.mark.parametrize("gamma", [-6.0, -12.0, -19.5])
def test_factored_chunks_near_the_limit_float32(monkeypatch, path, gamma):
    """Chunks that factor but decay far (``Γ`` from -6 to just inside -LIMIT, as Mamba-2's heads
    of middling ``A dt``): ``e^{G_i} · e^{Γ - G_s} · e^{-Γ}`` cancels exponents of up to 20, so
    each factor must be rounded once from float64 (qkv.recurrent.decay.intra.factors). Rounded from
    a float32 argument they erred by up to 10 eps each, and an output by 3-4x the float32 step
    loop's error; here within twice it, forward and backward."""
    if path == "numpy":
        monkeypatch.setitem(jit._loaded, jit.DECAY, None)
    elif jit.load(jit.DECAY) is None:
        pytest.skip("numba (the fast extra) is not available, or QKV_JIT=0")
    rng = np.random.default_rng(int(-gamma * 10))
    C, T = 16, 128
    x = mixed_problem(rng, T)
    x[3] = (gamma / C) * rng.uniform(0.9, 1.02, (1, 4, T))              # every chunk's Γ near `gamma`, inside -20
    x32 = [a.astype(np.float32) for a in x]
    seen = split_seen(monkeypatch)
    got = run(x32, C)
    assert not seen                                                      # every slab factored whole
    want, steps = oracle(x), oracle(x32, np.float32)
    floor = 2 * np.finfo(np.float32).eps
    for name, a, s, w in zip(NAMES, got, steps, want):
        assert a.dtype == np.float32 and np.isfinite(a).all(), name
        assert rel_to_top(a, w) <= 2.0 * max(rel_to_top(s, w), floor), (name, rel_to_top(a, w), rel_to_top(s, w))


def test_a_mask_overwritten_by_a_later_one_is_refused():
    """A steep slab's D lives in its thread's work array until the next mask: read after that it
    is an error, never the next slab's numbers; a copy taken before stays right."""
    G = np.cumsum(np.full((1, 2, 8, 1), -4.0), axis=2)                  # Γ = -32: the (C, C) path
    first = decay_intra.HeadDecay(G, np.float64)
    kept = first.D.copy()
    decay_intra.HeadDecay(2 * G, np.float64)                             # the thread's next mask
    with pytest.raises(RuntimeError, match="after the thread made another"):
        first.D
    np.testing.assert_array_equal(kept, np.tril(np.exp(G - np.swapaxes(G, -1, -2))))


def test_a_mask_is_read_from_another_thread_while_its_maker_keeps_it():
    """D belongs to the work array of the thread that made it: another thread may read it while
    that thread has made no later mask, and is refused once it has."""
    from concurrent.futures import ThreadPoolExecutor

    G = np.cumsum(np.full((1, 2, 8, 1), -4.0), axis=2)
    with ThreadPoolExecutor(1) as pool:
        made = pool.submit(decay_intra.HeadDecay, G, np.float64).result()
        decay_intra.HeadDecay(2 * G, np.float64)                         # a mask of this thread's: no matter
        np.testing.assert_array_equal(made.D, np.tril(np.exp(G - np.swapaxes(G, -1, -2))))
        pool.submit(decay_intra.HeadDecay, 2 * G, np.float64).result()   # the maker's next mask
    with pytest.raises(RuntimeError, match="after the thread made another"):
        made.D
