"""The stacked dense kernel (``qkv.kernels.stacked``), what ``method="auto"`` runs for short
sequences in big batches: the reference's bits, for any thread count."""
import numpy as np
import pytest

import qkv
from qkv import api
from qkv.kernels import stacked
from qkv.threads import kernel_threads

@pytest.fixture(autouse=True)
def no_row_kernel(monkeypatch):
    """auto as it chooses without the fast extra (with it, float32 goes to qkv.kernels.rows.kernel)."""
    monkeypatch.setattr(api, "AUTO_ROWS_MAX", 0)


CASES = [dict(), dict(causal=True), dict(causal="bottom_right"), dict(window=(5, 3)), dict(causal=True, chunk=7)]


def _inputs(shape_q, shape_kv, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(shape_q).astype(dtype)
    k, v = (rng.standard_normal(shape_kv).astype(dtype) for _ in range(2))
    dout = rng.standard_normal(shape_q).astype(dtype)
    return q, k, v, dout


@pytest.mark.parametrize("options", CASES)
@pytest.mark.parametrize("gqa", [False, True])
def test_auto_stacks_short_sequences_with_the_references_bits(options, gqa, monkeypatch):
    chosen = []
    real = api.choose_kernel
    monkeypatch.setattr(api, "choose_kernel", lambda *a: chosen.append(real(*a)) or chosen[-1])
    q, k, v, dout = _inputs((8, 8, 97, 24), (8, 4 if gqa else 8, 83, 24))  # 8 units over the threads
    ref = qkv.attention(q, k, v, gqa=gqa, return_lse=True, method="reference", **options)
    ref_grads = qkv.attention_backward(dout, q, k, v, *ref, gqa=gqa, method="reference", **options)
    for threads in (1, 2, 3):
        with kernel_threads(threads):
            out = qkv.attention(q, k, v, gqa=gqa, return_lse=True, **options)
            grads = qkv.attention_backward(dout, q, k, v, *out, gqa=gqa, **options)
        for got, want in zip(out + grads, ref + ref_grads):
            np.testing.assert_array_equal(got, want)
    assert chosen[-1] is api.STACKED


def test_units_cover_the_stack_in_whole_kv_groups():
    for n, t, g in ((384, 128, 1), (48, 64, 4), (7, 256, 1), (12, 200, 3)):
        units = stacked._units(n, t, t, g)
        assert units[0][0] == 0 and units[-1][1] == n
        assert all(b == c for (_, b), (c, _) in zip(units, units[1:]))
        assert all(a % g == 0 and b % g == 0 for a, b in units)


def test_per_head_masks_and_lengths_are_not_stacked():
    q, k, v, _ = _inputs((16, 4, 64, 16), (16, 4, 64, 16))  # 2^18 score entries: auto's stacking size
    prob = api.prepare(q, k, v, kv_lengths=np.arange(16) * 4)
    assert not stacked.applies(prob.spec) and api.choose_kernel("auto", prob, False) is not api.STACKED
    assert api.choose_kernel("auto", api.prepare(q, k, v, causal=True), False) is api.STACKED
    assert api.choose_kernel("auto", api.prepare(q, k, v), True) is not api.STACKED  # weights: the dense path
    assert api.choose_kernel("auto", api.prepare(q[:8], k[:8], v[:8]), False) is api.kernels.lookup("reference")  # small: all heads at once


@pytest.mark.parametrize("tq", [1, 4])
def test_auto_decodes_a_long_cache_with_the_tiled_kernel(tq):
    """A few queries against a long KV cache (Tk past the row kernels' keys): the dense paths
    while K, V and the scores' passes stay small (api.AUTO_LONG_KEYS_BYTES), the tiled kernel
    after, even where Tq·Tk is within the stacked kernel's size."""
    flash, reference = api.kernels.lookup("flash"), api.kernels.lookup("reference")

    def chosen(h, tk, d, **options):
        q, k, v, _ = _inputs((1, h, tq, d), (1, h, tk, d))
        prob = api.prepare(q, k, v, causal="bottom_right", **options)
        return api.choose_kernel("auto", prob, False), api._dense_bytes(prob)

    for h, tk, d in ((8, 16384, 128), (4, 65536, 32), (2, 65536, 128)):  # 8x16384 went to the reference,
        kern, size = chosen(h, tk, d)                                        # 4x65536 to the stacked kernel
        assert size >= api.AUTO_LONG_KEYS_BYTES and kern is flash
    assert chosen(4, 65536, 32, window=64)[0] is flash
    for h, tk, d in ((4, 4096, 32), (1, 16384, 64)):  # K and V in cache: the dense path
        kern, size = chosen(h, tk, d)
        assert size < api.AUTO_LONG_KEYS_BYTES and kern is reference
    kern, size = chosen(64, 1024, 64)  # short keys: no change, whatever the bytes (the row kernels' sizes)
    assert size >= api.AUTO_LONG_KEYS_BYTES and kern is not flash
