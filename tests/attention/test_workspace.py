"""The row kernels' per-thread scratch buffers (qkv.kernels.workspace)."""
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import qkv
from qkv.kernels import workspace
from qkv.kernels.rows import numpy_rows as rows_numpy
from qkv.threads import kernel_threads


def test_a_name_is_one_buffer_a_thread_grown_when_too_small():
    a = workspace.take("test-a", (4, 8))
    b = workspace.take("test-a", (2, 8))
    assert np.shares_memory(a, b) and b.shape == (2, 8) and b.flags.c_contiguous
    assert not np.shares_memory(a, workspace.take("test-b", (4, 8)))
    big = workspace.take("test-a", (64, 64))
    assert big.shape == (64, 64) and not np.shares_memory(a, big)
    assert np.shares_memory(big, workspace.take("test-a", (4, 8)))       # kept at the larger size
    with ThreadPoolExecutor(1) as other:
        theirs = other.submit(workspace.take, "test-a", (4, 8)).result()
    assert not np.shares_memory(theirs, big)
    assert workspace.take("test-a", (3,), np.float64).dtype == np.float64


def test_a_call_leaves_no_buffer_behind(monkeypatch):
    """Each thread lets go of its buffers at the end of its share of a call: a training step's
    peak memory does not carry them. (The NumPy row kernel's: the compiled one's scratch lives
    inside its compiled loop.)"""
    monkeypatch.setattr("qkv.api.AUTO_ROWS_NUMPY_MIN", 0)
    monkeypatch.setattr("qkv.kernels.rows.kernel.applies", lambda *a: False)
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 4, 64, 16)).astype(np.float32) for _ in range(3))
    workspace.take("test-c", (8,))
    out, lse = qkv.attention(q, k, v, causal=True, return_lse=True)
    assert getattr(workspace._local, "bufs", {}) == {}
    workspace.take("test-d", (8,))
    qkv.attention_backward(out, q, k, v, out, lse, causal=True)
    assert getattr(workspace._local, "bufs", {}) == {}


def test_zeros_and_a_product_into_a_buffer():
    z = workspace.zeros("test-z", (3, 5))
    z += 1
    assert (workspace.zeros("test-z", (3, 5)) == 0).all()
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 3, 4)).astype(np.float32), rng.standard_normal((2, 4, 5)).astype(np.float32)
    np.testing.assert_allclose(workspace.matmul(a, b, "test-m"), a @ b, rtol=1e-6)
    x = rng.standard_normal((2, 7, 3)).astype(np.float32)
    t = workspace.transposed(x, "test-t")
    assert t.flags.c_contiguous and (t == np.swapaxes(x, -1, -2)).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_results_never_share_a_buffer_and_a_second_call_leaves_the_first_intact(threads, monkeypatch):
    """What the kernels return is the caller's own: the next call (which reuses every
    buffer) leaves it as it was."""
    monkeypatch.setattr(rows_numpy, "UNIT_ENTRIES", 1 << 12)   # several units a thread
    monkeypatch.setattr("qkv.kernels.rows.kernel.SERIAL_WORK", 0)
    monkeypatch.setattr(rows_numpy, "FORWARD_SERIAL_WORK", 0)
    monkeypatch.setattr("qkv.api.AUTO_ROWS_NUMPY_MIN", 0)
    monkeypatch.setattr("qkv.kernels.rows.kernel.applies", lambda *a: False)   # the NumPy-only kernel
    calls = []
    monkeypatch.setattr(rows_numpy, "_block", lambda *a, f=rows_numpy._block: calls.append(1) or f(*a))
    rng = np.random.default_rng(1)
    q, k, v, d = (rng.standard_normal((2, 4, 64, 16)).astype(np.float32) for _ in range(4))
    with kernel_threads(threads):
        first = qkv.attention(q, k, v, causal=True, return_lse=True)
        grads = qkv.attention_backward(d, q, k, v, *first, causal=True)
        kept = [x.copy() for x in (*first, *grads)]
        again = qkv.attention(q[::-1].copy(), k, v, causal=True, return_lse=True)
        qkv.attention_backward(d[::-1].copy(), q, k, v, *again, causal=True)
    assert calls
    for x, y in zip((*first, *grads), kept):
        np.testing.assert_array_equal(x, y)


def test_import_leaves_malloc_alone_until_a_kernel_runs():
    """``import qkv`` frees no block of its own; the first buffer a row kernel takes does (once)."""
    import subprocess
    import sys

    code = ("import numpy as np, qkv; from qkv.kernels import workspace as w; a = bool(w._primed); "
            "x = np.ones((2, 4, 64, 16), np.float32); qkv.attention(x, x, x); print(a, bool(w._primed))")
    env = dict(os.environ, QKV_JIT="0")   # the NumPy row kernel: the one with workspace buffers
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    assert out == ["False", "True"]
