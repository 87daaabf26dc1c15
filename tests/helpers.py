"""Shared test helpers: the mask and bias of the one test-side oracle (tests/oracle.py, written
from the README's definitions rather than from qkv.masks) under the names the tests use,
random inputs, and the launcher of the tests that run under mpiexec."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

import oracle


def oracle_allowed(lead, tq, tk, *, causal=False, align=None, window=None, chunk=None,
                   kv_lengths=None, q_lengths=None, mask=None):
    """Bool (*lead, Tq, Tk), True = may attend: :func:`oracle.allowed` (tests/oracle.py, the
    one test-side oracle, written from the README's definitions)."""
    return oracle.allowed(lead, tq, tk, causal=causal, align=align, window=window, chunk=chunk,
                          kv_lengths=kv_lengths, q_lengths=q_lengths, mask=mask)


def oracle_bias(lead, tq, tk, *, causal=False, align=None, kv_lengths=None, q_lengths=None,
                bias=None, alibi=None):
    """Float (*lead, Tq, Tk): bias plus ALiBi's -slope*|i' - j|: :func:`oracle.additive`."""
    return oracle.additive(lead, tq, tk, causal=causal, align=align, kv_lengths=kv_lengths,
                           q_lengths=q_lengths, bias=bias, alibi=alibi)


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
        pytest.skip("no mpiexec next to the interpreter or on PATH (pip install -e '.[mpi]')")
    paths = [str(Path(__file__).parent.parent / "src")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return subprocess.run([exe, "-n", str(n), sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=os.pathsep.join(paths)))


def worst(errors: dict) -> tuple:
    """``(largest error, its name)`` of a ``{name: error}`` dict (the gradient checks' report)."""
    name = max(errors, key=errors.get)
    return errors[name], name


# --- a training text (the GPT tests: layers/, distributed/) ---------------------------------

WORDS = ("the king my lord and of to a you is that in not me it his with be your for this but he "
         "have thou so him what by shall will do no all are we our as sir good now o if come more").split()


def text_corpus(n_lines: int = 400, seed: int = 0) -> str:
    """A small play-like text: speaker names and lines of common words (about 50 characters a line)."""
    rng = np.random.default_rng(seed)
    names = ["KING", "QUEEN", "FOOL"]
    lines = []
    for i in range(n_lines):
        words = rng.choice(WORDS, size=rng.integers(4, 12))
        lines.append(f"{names[i % 3]}:\n{' '.join(words).capitalize()}.\n")
    return "\n".join(lines)
