"""Test-side oracles, written independently of qkv.masks, so the tests check semantics
rather than repeat the implementation; and the launcher of the tests that run under mpiexec."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np


def _alignment(causal, align):
    """(causal on?, align) as DESIGN.md defines the shorthands."""
    if isinstance(causal, str):
        return True, causal
    return bool(causal), align or "top_left"


def _offsets(lead, tq, tk, align, kv_lengths, q_lengths):
    """Per batch item b, the offset of i' = i + offset: 0, or Tk_b - Tq_b (real lengths)."""
    batch = lead[0] if lead else 1
    out = []
    for b in range(batch):
        real_k = tk if kv_lengths is None else int(np.asarray(kv_lengths)[b])
        real_q = tq if q_lengths is None else int(np.asarray(q_lengths)[b])
        out.append(real_k - real_q if align == "bottom_right" else 0)
    return out


def oracle_allowed(lead, tq, tk, *, causal=False, align=None, window=None, chunk=None,
                   kv_lengths=None, q_lengths=None, mask=None):
    """Bool (*lead, Tq, Tk), True = may attend, straight from DESIGN.md's definitions, one
    entry at a time."""
    on, align = _alignment(causal, align)
    offsets = _offsets(lead, tq, tk, align, kv_lengths, q_lengths)
    left, right = (None, None) if window is None else ((window, 0) if isinstance(window, int) else window)
    ok = np.ones(tuple(lead) + (tq, tk), dtype=bool)
    for b, off in enumerate(offsets):
        for i in range(tq):
            ip = i + off
            for j in range(tk):
                allowed = True
                if on and j > ip:
                    allowed = False
                if left is not None and j < ip - left:
                    allowed = False
                if right is not None and j > ip + right:
                    allowed = False
                if chunk is not None and ip // chunk != j // chunk:
                    allowed = False
                if kv_lengths is not None and j >= int(np.asarray(kv_lengths)[b]):
                    allowed = False
                if q_lengths is not None and i >= int(np.asarray(q_lengths)[b]):
                    allowed = False
                if lead:
                    ok[b, ..., i, j] = allowed
                else:
                    ok[i, j] = allowed
    if mask is not None:
        ok &= mask
    return ok


def oracle_bias(lead, tq, tk, *, causal=False, align=None, kv_lengths=None, q_lengths=None,
                bias=None, alibi=None):
    """Float (*lead, Tq, Tk): bias plus ALiBi's -slope*|i' - j| (slopes (Hq,) or (B, Hq))."""
    add = np.zeros(tuple(lead) + (tq, tk))
    if bias is not None:
        add = add + bias
    if alibi is not None:
        _, align = _alignment(causal, align)
        alibi = np.asarray(alibi)
        for b, off in enumerate(_offsets(lead, tq, tk, align, kv_lengths, q_lengths)):
            dist = np.abs(np.arange(tq)[:, None] + off - np.arange(tk)[None, :])
            slopes = alibi if alibi.ndim == 1 else alibi[b]
            add[b] = add[b] - slopes.reshape((-1,) + (1, 1)) * dist
    return add


def random_case(rng, *, dtype=np.float64, b=2, hq=4, hkv=2, tq=7, tk=9, d=8, dv=None):
    dv = d if dv is None else dv
    q = rng.standard_normal((b, hq, tq, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, tk, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, tk, dv)).astype(dtype)
    return q, k, v


def mpiexec(n: int, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``mpiexec -n n python *args`` with this checkout's src/ first on PYTHONPATH, its output
    captured; a skip with the reason where mpi4py or mpiexec is missing."""
    import pytest

    pytest.importorskip("mpi4py", reason="the mpi extra (mpi4py with mpich) is not installed")
    exe = Path(sys.executable).parent / "mpiexec"
    exe = str(exe) if exe.exists() else shutil.which("mpiexec")
    if exe is None:
        pytest.skip("no mpiexec next to the interpreter or on PATH (pip install 'qkv[mpi]')")
    paths = [str(Path(__file__).parent.parent / "src")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return subprocess.run([exe, "-n", str(n), sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=os.pathsep.join(paths)))
