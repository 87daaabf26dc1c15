"""qkv.threads: the kernels' thread count and the counted one-thread BLAS hold."""
from concurrent.futures import ThreadPoolExecutor

import pytest
from threadpoolctl import threadpool_info

import qkv
from qkv import threads


def blas_threads():
    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


def test_set_num_threads_round_trips_and_refuses_nonsense():
    before = qkv.get_num_threads()
    try:
        qkv.set_num_threads(3)
        assert qkv.get_num_threads() == 3
        qkv.set_num_threads(None)
        assert qkv.get_num_threads() >= 1
        for bad in (0, -1, 1.5, True, "2"):
            with pytest.raises(qkv.ShapeError, match="num_threads must be an int >= 1"):
                qkv.set_num_threads(bad)
    finally:
        qkv.set_num_threads(before)


def test_a_pools_only_limit_leaves_compiled_kernels_threads_alone():
    """kernel_threads(n, pools_only=True) caps the kernels on Python threads (the smaller of it
    and the setting stands) and not get_num_threads(compiled=True); it ends with its block."""
    before = qkv.get_num_threads()
    try:
        qkv.set_num_threads(4)
        with threads.kernel_threads(1, pools_only=True):
            assert (threads.get_num_threads(), threads.get_num_threads(compiled=True)) == (1, 4)
            with threads.kernel_threads(3):
                assert (threads.get_num_threads(), threads.get_num_threads(compiled=True)) == (1, 3)
        with threads.kernel_threads(6, pools_only=True):
            assert threads.get_num_threads() == 4
        with threads.one_thread_if(True, pools_only=True):
            assert (threads.get_num_threads(), threads.get_num_threads(compiled=True)) == (1, 4)
        with threads.one_thread_if(True):
            assert (threads.get_num_threads(), threads.get_num_threads(compiled=True)) == (1, 1)
        assert (threads.get_num_threads(), threads.get_num_threads(compiled=True)) == (4, 4)
        with pytest.raises(qkv.ShapeError, match="num_threads must be an int >= 1"):
            with threads.kernel_threads(0, pools_only=True):
                pass
    finally:
        qkv.set_num_threads(before)


def test_blas_hold_is_counted_and_restored():
    before = blas_threads()
    with threads.blas_one_thread():
        assert threads.blas_holders() == 1
        assert all(n == 1 for n in blas_threads())
        with threads.blas_one_thread():
            assert threads.blas_holders() == 2
        assert threads.blas_holders() == 1 and all(n == 1 for n in blas_threads())
    assert threads.blas_holders() == 0
    assert blas_threads() == before


def test_concurrent_holders_leave_nothing_held():
    def job(_):
        with threads.blas_one_thread():
            return threads.blas_holders() >= 1

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(job, range(16)))
    assert threads.blas_holders() == 0


def test_a_pool_handed_out_still_runs_after_another_caller_grows_it():
    held = threads.pool(2)  # a kernel took the pool, then another thread asked for more
    threads.pool(threads._state["pool_size"] + 1)
    assert list(held.map(lambda x: x * x, range(4))) == [0, 1, 4, 9]


def test_a_hold_from_any_thread_limits_blas_and_any_thread_restores_it():
    """threadpoolctl 3.8 lets only the thread that first set OpenBLAS's pool change it and
    skips the others silently; the hold must still reach BLAS when the main thread has that
    claim, and the last release, made on another thread than the first hold, must restore."""
    import threading

    from threadpoolctl import threadpool_limits

    if not blas_threads():
        pytest.skip("no BLAS that threadpoolctl controls")
    original = threadpool_limits(limits=2, user_api="blas")  # the main thread claims OpenBLAS
    try:
        assert blas_threads() == [2] * len(blas_threads())
        seen = []
        first = threading.Thread(target=lambda: (threads.hold_blas(), seen.append(blas_threads())))
        first.start()
        first.join()
        threads.hold_blas()                                      # a second, counted holder
        second = threading.Thread(target=threads.release_blas)
        second.start()
        second.join()
        assert seen == [[1] * len(blas_threads())] and all(n == 1 for n in blas_threads())
        last = threading.Thread(target=threads.release_blas)    # not the thread that set it
        last.start()
        last.join()
        assert threads.blas_holders() == 0
        assert blas_threads() == [2] * len(blas_threads())
    finally:
        original.restore_original_limits()
        threads._drop_claim()


@pytest.mark.parametrize("direct", [True, False])
def test_the_hold_sets_and_restores_through_either_path(direct, monkeypatch):
    """NumPy's OpenBLAS is held through its own set function; any other BLAS (here: the direct
    path refused) through threadpoolctl. Either way one thread while held, as found after."""
    from threadpoolctl import threadpool_limits

    if not blas_threads():
        pytest.skip("no BLAS that threadpoolctl controls")
    if direct:
        assert threads._openblas_pools(threads._controller()), "NumPy's wheel carries a pthreads OpenBLAS"
    else:
        monkeypatch.setattr(threads, "_openblas_pools", lambda ctl: None)
    original = threadpool_limits(limits=2, user_api="blas")
    try:
        with threads.blas_one_thread():
            assert all(n == 1 for n in blas_threads())
        assert blas_threads() == [2] * len(blas_threads())
    finally:
        original.restore_original_limits()
        threads._drop_claim()


def test_kernel_threads_hold_for_the_calling_thread_only(monkeypatch):
    import numpy as np

    saved = threads._state["threads"]  # the process-wide default as set (None: the CPU count)
    sizes = []
    real_pool = threads.pool
    monkeypatch.setattr(threads, "pool", lambda n: sizes.append(n) or real_pool(n))
    x = np.random.default_rng(0).standard_normal((4, 300, 16)).astype(np.float32)  # tiles go to threads
    try:
        qkv.set_num_threads(3)
        with threads.kernel_threads(1):
            assert qkv.get_num_threads() == 1
            with ThreadPoolExecutor(1) as other:  # another thread keeps the process-wide default
                assert other.submit(qkv.get_num_threads).result() == 3
            qkv.attention(x, x, x, method="flash")
        assert sizes == [] and qkv.get_num_threads() == 3
        qkv.attention(x, x, x, method="flash")
        assert sizes and set(sizes) == {3}
        with pytest.raises(qkv.ShapeError, match="num_threads must be an int >= 1"):
            with threads.kernel_threads(0):
                pass
    finally:
        qkv.set_num_threads(saved)


_FORK = r"""
import hashlib, json, multiprocessing as mp, sys
import numpy as np
import qkv
from qkv.models import GPT, GPTConfig

def work():
    # the row kernel's compiled loop over heads (forward and backward), then a GPT step of attention
    # blocks: its products, GELU and attention on numba's threads (qkv.nn.products.one_pool)
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((2, 4, 64, 32)).astype(np.float32) for _ in range(4))
    out, lse = qkv.attention(q, k, v, causal=True, return_lse=True)
    grads = qkv.attention_backward(do, q, k, v, out, lse, causal=True)
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=128, activation="gelu", seed=1))
    idx = rng.integers(0, 65, (4, 64))
    loss = model.loss(idx, idx)
    model.backward()
    h = hashlib.sha256()
    for a in (out, lse, *grads, np.float32(loss), *model.grads.values()):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()

def child(conn):
    conn.send(work())

if __name__ == "__main__":
    qkv.set_num_threads(2)
    import numba
    mine = work()                                            # numba's threads now run in this process
    results = []
    for method in ("fork", "spawn"):
        ctx = mp.get_context(method)
        a, b = ctx.Pipe()
        p = ctx.Process(target=child, args=(b,))
        p.start()
        p.join(240)
        results.append({"method": method, "exitcode": p.exitcode, "hash": a.recv() if a.poll() else None})
    print(json.dumps({"layer": numba.threading_layer(), "parent": mine, "children": results}))
"""


@pytest.mark.slow
def test_a_forked_child_runs_the_compiled_kernels_with_its_parents_bits(tmp_path):
    """numba's GNU OpenMP layer kills a child forked after a parallel loop ran, at its first one
    (a multiprocessing worker, a pre-forking server's); with the fast extra's TBB numba takes its
    TBB layer (qkv.threads.prefer_tbb), and a forked child runs the row kernel and a pooled GPT
    step to the parent's bits, as a spawned one does."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("numba", reason="the fast extra (numba) is not installed")
    if not hasattr(os, "fork"):
        pytest.skip("no fork() on this platform")
    import importlib.metadata
    try:
        importlib.metadata.distribution("tbb")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the tbb wheel (the fast extra's, Linux x86-64) is not installed: numba's OpenMP layer is not fork-safe")
    script = tmp_path / "fork_child.py"
    script.write_text(_FORK)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["layer"] == "tbb", found
    for child in found["children"]:
        assert child["exitcode"] == 0 and child["hash"] == found["parent"], (found, out.stderr[-2000:])
