"""attn_implementation="qkv" on packed sequences whose keys outnumber their queries
(flash-attention's varlen kwargs ``cu_seq_lens_q`` / ``cu_seq_lens_k`` with a past per
sequence: chunked prefill, transformers' continuous batching): each sequence causal on its
own with its last query on its last key, against torch SDPA run on each sequence alone."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
pytest.importorskip("transformers", reason="the hf extra is not installed")

from qkv.torch.hf import hf_attention  # noqa: E402


class Layer(torch.nn.Module):
    is_causal = True


def _packed(rng, q_lens, past, hq=4, hkv=2, d=8):
    """Per-sequence q (1, Hq, Tq_s, D), k, v (1, Hkv, past_s + Tq_s, D), and the packed buffers
    with their cumulative lengths."""
    seqs = []
    for n, p in zip(q_lens, past):
        seqs.append([torch.tensor(rng.standard_normal((1, h, t, d))) for h, t in ((hq, n), (hkv, n + p), (hkv, n + p))])
    cat = [torch.cat([s[i] for s in seqs], dim=2) for i in range(3)]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(np.add(q_lens, past))]), dtype=torch.int32)
    return seqs, cat, cu_q, cu_k


def _sdpa(q, k, v, window=None):
    """One sequence: bottom-right causal (the last query on the last key), the window's keys."""
    tq, tk = q.shape[-2], k.shape[-2]
    i = torch.arange(tq)[:, None] + tk - tq
    j = torch.arange(tk)[None, :]
    allowed = (j <= i) if window is None else (j <= i) & (j > i - window)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)


def _err(q_lens, past, seed, window=None):
    rng = np.random.default_rng(seed)
    seqs, (q, k, v), cu_q, cu_k = _packed(rng, q_lens, past)
    kw = {} if window is None else {"sliding_window": window}
    out, _ = hf_attention(Layer(), q, k, v, None, scaling=q.shape[-1] ** -0.5,
                          cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, **kw)          # (1, ΣTq, Hq, D)
    want = torch.cat([_sdpa(*s, window) for s in seqs], dim=2).transpose(1, 2)   # (1, ΣTq, Hq, D)
    return float((out - want).abs().max())


def test_segments_with_past_keys_are_each_bottom_right_causal():
    """Query lengths [5, 5] with past [9, 4]: the buffer's causal mask made this 1.16."""
    assert _err([5, 5], [9, 4], 0) < 1e-12


@pytest.mark.parametrize("seed", range(6))
def test_random_query_and_past_lengths(seed):
    """Many segments, 1-token queries (decoding steps) beside prefill chunks, past 0 included."""
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 9))
    q_lens = rng.integers(1, 7, n)
    q_lens[rng.random(n) < 0.3] = 1
    past = rng.integers(0, 10, n)
    past[rng.random(n) < 0.3] = 0
    if (past == 0).all():
        past[0] = 3                       # keys outnumber queries somewhere
    assert _err(q_lens.tolist(), past.tolist(), seed) < 1e-12


@pytest.mark.parametrize("window", [1, 3, 6])
def test_sliding_window_per_segment(window):
    """The layer's ``sliding_window`` as flash-attention takes it: the query and the
    ``window - 1`` keys before it, counted in its own sequence."""
    assert _err([4, 1, 6, 2], [7, 12, 0, 5], 7, window) < 1e-12


def test_equal_lengths_keep_the_packed_causal_path():
    """cu_seq_lens_k == cu_seq_lens_q: the same result as each sequence alone (no past)."""
    assert _err([3, 7, 1], [0, 0, 0], 3) < 1e-12
