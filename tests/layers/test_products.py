"""qkv.nn.products: the layers' float32 products cut in pieces of rows on numba's threads, with
the whole product's bits for every thread count, and NumPy's product wherever that cannot hold."""
import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from qkv import jit, threads
from qkv.nn import products

needs_pool = pytest.mark.skipif(not jit.enabled() or products.grain() == 0,
                                reason="the pool needs numba (the fast extra), a BLAS sgemm and a grain")


@pytest.fixture(autouse=True)
def _pool():
    """Every test here inside one_pool(), as a GPT of attention blocks runs its step."""
    with products.one_pool():
        yield


def _whole(a, b):
    """NumPy's product on one BLAS thread: the bits every cut must keep."""
    with threadpool_limits(1, "blas"):
        return np.matmul(a, b)


def _operands(rng, m, k, n, ta, tb):
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32) * 30   # scores-sized entries
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
    return (a.T if ta else a), (b.T if tb else b)


@needs_pool
@pytest.mark.parametrize("m, k, n", [(768, 128, 512), (128, 768, 512), (84, 768, 128), (50, 300, 1000),
                                     (1000, 64, 3), (4099, 384, 67), (49, 5461, 2),
                                     # about OpenBLAS's SkylakeX small-matrix bound (10^6 multiply-adds,
                                     # a @ b.T's also m·n <= 1200 and k >= 32): wholes and pieces astride it
                                     (300, 64, 40), (1200, 30, 40), (100, 100, 101), (2100, 40, 25),
                                     (4200, 40, 25), (30, 100, 1001)])
@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True), (True, True)])
def test_a_cut_product_has_the_whole_products_bits_on_every_thread_count(m, k, n, ta, tb):
    rng = np.random.default_rng(m + k + n)
    a, b = _operands(rng, m, k, n, ta, tb)
    want = _whole(a, b)
    for nt in (1, 2, 3, 4):
        with threads.kernel_threads(nt):
            got = products.matmul(a, b)
            out = np.full((m, n), np.nan, np.float32)
            into = products.matmul(a, b, out=out)
        assert into is out
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


@needs_pool
def test_the_pieces_run_on_numbas_threads_with_blas_held(monkeypatch):
    """Two kernel threads: two pieces of rows at a multiple of the grain, numba's thread count
    2 and BLAS held while they run; the count put back after."""
    import numba
    mod = jit.load(jit.PRODUCTS)
    seen = []
    real = mod.split_gemm

    def spy(*args):
        seen.append((args[-1].tolist(), numba.get_num_threads(), threads.blas_holders()))
        return real(*args)
    monkeypatch.setattr(mod, "split_gemm", spy)
    before = numba.get_num_threads()
    a, b = _operands(np.random.default_rng(0), 600, 128, 40, False, False)   # pieces past least_work
    with threads.kernel_threads(2):
        products.matmul(a, b)
    g = products.grain()
    (bounds, nt, held), = seen
    assert len(bounds) == 3 and bounds[0] == 0 and bounds[-1] == 600 and bounds[1] % g == 0
    assert nt == min(2, numba.config.NUMBA_NUM_THREADS) and held >= 1
    assert numba.get_num_threads() == before and threads.blas_holders() == 0


@needs_pool
def test_no_piece_does_less_than_the_least_work(monkeypatch):
    """Every piece of a cut product starts at a multiple of the grain and does at least
    least_work() multiply-adds (the pieces BLAS would round otherwise), over shapes about it."""
    mod = jit.load(jit.PRODUCTS)
    seen = []
    real = mod.split_gemm

    def spy(*args):
        seen.append(args[-1].copy())
        return real(*args)
    monkeypatch.setattr(mod, "split_gemm", spy)
    g, least = products.grain(), products.least_work()
    rng = np.random.default_rng(5)
    cut = 0
    for _ in range(60):
        m, k, n = int(rng.integers(24, 3000)), int(rng.integers(8, 300)), int(rng.integers(2, 300))
        a, b = _operands(rng, m, k, n, False, False)
        seen.clear()
        with threads.kernel_threads(int(rng.integers(2, 5))):
            products.matmul(a, b)
        for bounds in seen:
            rows = np.diff(bounds)
            assert bounds[0] == 0 and bounds[-1] == m and (bounds[1:-1] % g == 0).all()
            assert len(rows) == 1 or (rows * n * k >= least).all(), (m, k, n, bounds)
            cut += len(rows) > 1
    assert cut >= 10          # the sweep did cut products


@needs_pool
def test_a_product_numba_cannot_take_is_numpys(monkeypatch):
    """float64, a product under SPLIT_WORK, one column or one row (NumPy's gemv), x @ x.T
    (NumPy's syrk), an operand with strides BLAS cannot read as a matrix, mixed dtypes, an
    ``out`` over an operand and arrays that are not 2-D go to NumPy's matmul: its values."""
    mod = jit.load(jit.PRODUCTS)
    monkeypatch.setattr(mod, "split_gemm", lambda *a: pytest.fail("split_gemm ran"))
    rng = np.random.default_rng(1)
    a = rng.standard_normal((300, 200)).astype(np.float32)
    b = rng.standard_normal((200, 100)).astype(np.float32)
    with threads.kernel_threads(2):
        np.testing.assert_array_equal(products.matmul(a.astype(np.float64), b.astype(np.float64)),
                                      np.matmul(a.astype(np.float64), b.astype(np.float64)))
        np.testing.assert_array_equal(products.matmul(a[:10, :20], b[:20, :5]), np.matmul(a[:10, :20], b[:20, :5]))
        np.testing.assert_array_equal(products.matmul(a[::2], b), np.matmul(a[::2], b))
        np.testing.assert_array_equal(products.matmul(a, b[:, :1]), np.matmul(a, b[:, :1]))
        wide = rng.standard_normal((2000, 200)).astype(np.float32)
        np.testing.assert_array_equal(products.matmul(a[:1], wide.T), np.matmul(a[:1], wide.T))
        np.testing.assert_array_equal(products.matmul(wide, wide.T), np.matmul(wide, wide.T))
        np.testing.assert_array_equal(products.matmul(a[0], b), np.matmul(a[0], b))              # 1-D: NumPy's rules
        stack = np.stack([a, a])
        np.testing.assert_array_equal(products.matmul(stack, b), np.matmul(stack, b))            # 3-D too
        np.testing.assert_array_equal(products.matmul(a, b.astype(np.float64)), np.matmul(a, b.astype(np.float64)))
        square = rng.standard_normal((200, 200)).astype(np.float32)
        want = np.matmul(square, square)
        got = products.matmul(square, square, out=square)     # NumPy copies an overlapping out
        np.testing.assert_array_equal(got, want)


def test_no_grain_means_numpys_products_and_passes_off_the_pool(monkeypatch):
    """A BLAS whose cut products round otherwise at every grain tried (here: no grain to try)
    leaves the products to NumPy, the passes and a layer's small attention off numba's threads."""
    monkeypatch.setattr(products, "_found", {})
    monkeypatch.setattr(products, "GRAINS", ())
    assert products.grain() == 0 and not products.pooled() and products.threads_for(1 << 20, 1) == 1
    with products.one_pool():
        assert not products.pooled()
    if jit.enabled():
        monkeypatch.setattr(jit.load(jit.PRODUCTS), "split_gemm", lambda *a: pytest.fail("split_gemm ran"))
    a = np.random.default_rng(2).standard_normal((300, 200)).astype(np.float32)
    with threads.kernel_threads(2):
        np.testing.assert_array_equal(products.matmul(a, a.T), np.matmul(a, a.T))


@needs_pool
def test_the_probe_refuses_a_grain_that_changes_a_bit(monkeypatch):
    """The probe compares bits: a kernel whose pieces round otherwise (one ulp off in every
    piece that does not start at row 0) fails it at every grain; the grain found passes it
    with the real kernel; on OpenBLAS's Haswell kernels a grain of 5 rows cuts their row
    blocks and fails it; on its SkylakeX kernels every grain fails with pieces small enough
    for the small-matrix kernels (10^6 multiply-adds or fewer), and a piece's least work is past them."""
    mod = jit.load(jit.PRODUCTS)
    with threads.numba_threads(1):            # as grain() probes: BLAS held to one thread
        assert products._probe(mod, products.grain(), products.least_work())
        if threads.blas_core() == "haswell":
            assert not products._probe(mod, 5)
        if threads.blas_core() == "skylakex":   # small-matrix kernels: pieces of 10^6 or fewer round otherwise
            assert products.least_work() > 10 ** 6 and not products._probe(mod, products.grain())
    real = mod.split_gemm

    def off_by_an_ulp(addr, ta, tb, a, b, c, bounds):
        real(addr, ta, tb, a, b, c, bounds)
        for r0, r1 in zip(bounds[1:-1], bounds[2:]):
            c[r0:r1] = np.nextafter(c[r0:r1], np.float32(np.inf))
    monkeypatch.setattr(mod, "split_gemm", off_by_an_ulp)
    with threads.numba_threads(1):
        assert not any(products._probe(mod, g, w) for g in products.GRAINS for w in products.LEAST_WORKS)


@needs_pool
def test_a_gpt_step_has_the_same_bits_on_one_thread_and_two():
    """nanoGPT's CPU recipe's shapes (smaller batch): loss, every gradient and the updated
    weights, bit for bit, with one kernel thread and two (products, attention and GELU cut)."""
    from qkv.models import GPT, GPTConfig
    from qkv.nn import AdamW

    rng = np.random.default_rng(3)
    idx, tgt = rng.integers(0, 65, (4, 64)), rng.integers(0, 65, (4, 64))
    runs = []
    for nt in (1, 2):
        with threads.kernel_threads(nt):
            model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=128, bias=False,
                                  activation="gelu", seed=4))
            loss = model.loss(idx, tgt)
            model.backward()
            grads = [g.copy() for g in model.grads.values()]
            AdamW([model], lr=1e-3).step()
            runs.append([np.float32(loss)] + grads + [p.copy() for p in model.params.values()])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


@needs_pool
def test_only_a_model_whose_every_product_runs_here_enters_the_pool(monkeypatch):
    """A float32 GPT of attention blocks (windowed, chunked, with a short conv too) runs its
    forward and backward inside one_pool(); one with a recurrent mixer, another attention class
    or float64 weights runs them outside (their NumPy products would spin OpenBLAS's threads
    against numba's); outside any, matmul is NumPy's product and the passes stay off numba's threads."""
    from qkv.models import GPT, GPTConfig
    from qkv.models import gpt as gpt_module
    from qkv.nn import MultiHeadAttention

    class Other(MultiHeadAttention):
        pass
    seen = []
    real = gpt_module.matmul
    monkeypatch.setattr(gpt_module, "matmul", lambda *a, **kw: seen.append(products.pooled()) or real(*a, **kw))
    small = dict(vocab_size=65, block_size=64, n_layer=2, n_head=2, n_embd=32)
    idx = np.zeros((2, 64), np.int64)
    with products.one_pool(False):
        for layers, attention, dtype, want in (
                (None, None, np.float32, True), ("attention:window=8,attention:chunk=16:conv=3", None, np.float32, True),
                ("attention,mamba2", None, np.float32, False), ("gated_delta,attention", None, np.float32, False),
                (None, Other, np.float32, False), (None, None, np.float64, False)):
            model = GPT(GPTConfig(**small, layers=layers, dtype=dtype), attention=attention)
            assert model.one_pool == want
            seen.clear()
            model.loss(idx, idx)
            model.backward()
            assert seen and set(seen) == {want}
        assert not products.pooled() and products.threads_for(1 << 20, 1) == 1


_WATCH = r"""
import json, os, sys, threading, time
import numpy as np                                   # OpenBLAS starts its worker threads here
main = str(threading.get_native_id())
blas = set(os.listdir("/proc/self/task")) - {main}


def ticks():                                         # CPU time (utime + stime) of OpenBLAS's workers
    total = 0
    for t in blas:
        with open(f"/proc/self/task/{t}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total


from qkv.models import GPT, GPTConfig
pool, layers = sys.argv[1] == "pool", sys.argv[2]
model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=128, activation="gelu",
                      layers=None if layers == "-" else layers))
model.one_pool = model.one_pool and pool
idx = np.random.default_rng(0).integers(0, 65, (12, 64))
for _ in range(2):
    model.loss(idx, idx); model.backward()
time.sleep(0.5)                                      # past OpenBLAS's spin (2^28 cycles)
before = ticks()
for _ in range(8):
    model.loss(idx, idx); model.backward()
print(json.dumps({"workers": len(blas), "ticks": ticks() - before}))
"""


@needs_pool
@pytest.mark.parametrize("layers", ["-", "attention:conv=3"])
def test_a_pooled_step_never_wakes_openblas_threads(layers):
    """In a fresh process with OpenBLAS at 2 threads: 8 training steps of a GPT of attention
    blocks (with Zoology's short convolution too) spend no CPU time on OpenBLAS's worker
    threads inside the pool (every product ran on numba's threads, BLAS held to one), and
    some outside it (the same steps with NumPy's products: the control that the watch sees)."""
    import json
    import os
    import subprocess
    import sys

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs Linux's /proc to read the threads' CPU time")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="2")
    found = {}
    for mode in ("pool", "numpy"):
        out = subprocess.run([sys.executable, "-c", _WATCH, mode, layers], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        found[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    if found["pool"]["workers"] < 1:
        pytest.skip("OpenBLAS started no worker thread here (one core?)")
    assert found["pool"]["ticks"] == 0, found
    assert found["numpy"]["ticks"] > 0, found


@needs_pool
def test_zoologys_attention_model_enters_the_pool_and_its_others_do_not(monkeypatch):
    """MQAR's Zoology LanguageModel: BaseConv then softmax attention, float32, runs its forward
    and backward inside one_pool() (its head's products too); with Based or Mamba-2 mixers, or
    in float64, outside. Pooled, the loss and gradients have the same bits on 1 and 2 threads,
    and agree with NumPy's products to float32 rounding."""
    from qkv.experiments.mqar import MQARConfig, zoology_model
    from qkv.models import zoology

    seen = []
    real = zoology.matmul
    monkeypatch.setattr(zoology, "matmul", lambda *a, **kw: seen.append(products.pooled()) or real(*a, **kw))
    cfg = MQARConfig()
    idx = np.random.default_rng(0).integers(0, 64, (4, 64))
    tgt = np.where(np.arange(64) % 8 == 7, idx, -1)
    with products.one_pool(False):
        for mixer, dtype, want in (("attention", np.float32, True), ("based", np.float32, False),
                                   ("mamba2", np.float32, False), ("attention", np.float64, False)):
            model = zoology_model(cfg, mixer, 64, 0, dtype=dtype)
            assert model.one_pool == want
            seen.clear()
            model.loss(idx, tgt)
            model.backward()
            assert seen and set(seen) == {want}
        runs = []
        for pooled, nt in ((True, 2), (True, 1), (False, 2)):
            model = zoology_model(cfg, "attention", 64, 0)
            model.one_pool = pooled
            with threads.kernel_threads(nt):
                runs.append([np.float32(model.loss(idx, tgt))])
                model.backward()
            runs[-1] += [g.copy() for g in model.grads.values()]
        for a, b, c in zip(*runs):
            np.testing.assert_array_equal(a, b)          # the pool's bits: any thread count
            np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-6)   # NumPy's products: other roundings


def test_a_model_cast_to_float64_leaves_the_pool(monkeypatch):
    """A float32 GPT whose weights are cast to float64 afterwards runs outside the pool."""
    from qkv.models import GPT, GPTConfig
    from qkv.models import gpt as gpt_module

    seen = []
    real = gpt_module.matmul
    monkeypatch.setattr(gpt_module, "matmul", lambda *a, **kw: seen.append(products._scope.get()) or real(*a, **kw))
    model = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=32))
    idx = np.zeros((2, 16), np.int64)
    model.forward(idx)
    model.dtype = np.float64
    for name in list(model.params):
        model.params[name] = model.params[name].astype(np.float64)
    model.forward(idx)
    assert seen == [True, False]
