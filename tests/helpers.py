"""Test-side oracles, written independently of qkv.masks, so the tests check semantics
rather than repeat the implementation."""
from __future__ import annotations

import numpy as np


def oracle_allowed(lead, tq, tk, *, causal=False, window=None, kv_lengths=None, mask=None):
    """Bool (*lead, Tq, Tk), True = may attend, straight from DESIGN.md's definitions."""
    align = {False: None, True: "top_left", "top_left": "top_left", "bottom_right": "bottom_right"}[causal]
    ok = np.ones((tq, tk), dtype=bool)
    for i in range(tq):
        ip = i + (tk - tq if align == "bottom_right" else 0)
        for j in range(tk):
            if align is not None and j > ip:
                ok[i, j] = False
            if window is not None:
                left, right = (window, 0) if isinstance(window, int) else window
                if left is not None and j < ip - left:
                    ok[i, j] = False
                if right is not None and j > ip + right:
                    ok[i, j] = False
    ok = np.broadcast_to(ok, tuple(lead) + (tq, tk)).copy()
    if kv_lengths is not None:
        for b, n in enumerate(np.asarray(kv_lengths)):
            if lead:
                ok[b, ..., n:] = False
            else:
                ok[..., n:] = False
    if mask is not None:
        ok &= mask
    return ok


def oracle_bias(lead, tq, tk, *, causal=False, bias=None, alibi=None):
    """Float (*lead, Tq, Tk): bias plus ALiBi's -slope*|i' - j|."""
    add = np.zeros(tuple(lead) + (tq, tk))
    if bias is not None:
        add = add + bias
    if alibi is not None:
        off = tk - tq if causal == "bottom_right" else 0
        i = np.arange(tq)[:, None] + off
        j = np.arange(tk)[None, :]
        add = add - np.asarray(alibi)[:, None, None] * np.abs(i - j)
    return add


def random_case(rng, *, dtype=np.float64, b=2, hq=4, hkv=2, tq=7, tk=9, d=8, dv=None):
    dv = d if dv is None else dv
    q = rng.standard_normal((b, hq, tq, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, tk, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, tk, dv)).astype(dtype)
    return q, k, v
