"""Same inputs, same bits: a float32 result depends on the inputs, the options and the thread
count only, never on what ran before in the process, on the process, or on timing (issue 34).

The kernels and their thread counts: the reference, the stacked dense kernel, both row
kernels and the tiled kernel's forward give the same bits on one thread and two (every head,
or query block, computed alone in an order fixed by the problem); the tiled kernel's
backward adds dQ in a buffer per thread, so one and two threads may differ, but each count
gives its own bits every time.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qkv.kernels.flash import exp2 as E

HERE = Path(__file__).parent
THREAD_FREE = ("reference", "stacked", "rows", "rows-numpy")   # and the tiled kernel's forward


def processes(histories, jit: bool) -> list[dict]:
    """What tests/attention/same_bits_cases.py prints, one fresh process a history (run at once)."""
    env = {k: v for k, v in os.environ.items() if k != "QKV_JIT"}
    if not jit:
        env["QKV_JIT"] = "0"
    env["PYTHONPATH"] = os.pathsep.join([str(HERE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    procs = [subprocess.Popen([sys.executable, str(HERE / "same_bits_cases.py"), *h], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for h in histories]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("jit", [True, False], ids=["fast extra", "QKV_JIT=0"])
def test_fresh_processes_and_call_histories_give_the_same_bits(jit):
    """Every kernel, forward and backward, on one thread and two, called twice: in a fresh
    process, and after histories of other calls (other shapes, masks, GQA, dropout, a GPT
    training step; one shuffled): one set of bits each. (The compiled row kernel gave other
    bits after a causal call of 100 keys: its row sums were added in an order LLVM chose at
    run time from where the heap had put a scratch row.)"""
    if jit:
        pytest.importorskip("numba", reason="the fast extra (numba) is not installed")
    histories = [[], ["causal100"], ["window40", "gpt"], ["shuffle=0"]] if jit else [[], ["causal100"], ["shuffle=0"]]
    runs = processes(histories, jit)
    assert any(key.startswith("rows ") for key in runs[0]) == jit
    differ = {key: sorted(set().union(*(run[key] for run in runs))) for key in runs[0]}
    differ = {key: seen for key, seen in differ.items() if len(seen) > 1}
    assert not differ, f"other bits in another process, after other calls or in a repeated call: {differ}"
    for key, (bits,) in runs[0].items():                # the thread count: no knob where none is promised
        name, _, way, n = key.split(" ")
        if n == "t2" and (name in THREAD_FREE or (name == "flash" and way == "fwd")):
            assert [bits] == runs[0][key[:-1] + "1"], f"{key}: two threads' bits are not one's"


def test_the_numpy_exponential_is_a_rule_of_the_machine_not_a_measurement(monkeypatch):
    """The tiled kernel's NumPy exponential (QKV_JIT=0; and tiles numba does not take) is the
    same whichever path would time faster at the first call: it used to be measured, and a
    loaded machine gave some processes the other path (other bits)."""
    import time

    names = {"numpy exp2": "_np_exp2", "numpy exp": "_np_exp"}
    real = {path: getattr(E, name) for path, name in names.items()}

    def slowed(path):                                   # the path, 2 ms slower a call
        def run(x):
            time.sleep(0.002)
            real[path](x)
        run.path = path
        return run

    picks = []
    for slow in names:
        monkeypatch.setattr(E, "_chosen", [])           # a first call again
        monkeypatch.setattr(E, names[slow], slowed(slow))
        fn = E._choose().numpy
        picks.append(getattr(fn, "path", None) or next(p for p, f in real.items() if f is fn))
        monkeypatch.setattr(E, names[slow], real[slow])
    assert picks[0] == picks[1], f"the choice followed the clock: {picks}"
    assert picks[0] == ("numpy exp2" if E.numpy_exp2_vectorised() else "numpy exp")


def test_numpy_exp2_vectorised_follows_numpys_dispatch():
    """np.exp2 is taken where NumPy runs float32 exp2 on a vector loop (its AVX-512 one)."""
    introspect = pytest.importorskip("numpy.lib.introspect", reason="NumPy < 2.1 has no dispatch table")
    loops = introspect.opt_func_info(func_name="^exp2$", signature="float32")["exp2"]
    vector = any(not t["current"].startswith("baseline") for t in loops.values())
    assert E.numpy_exp2_vectorised() == vector


@pytest.mark.parametrize("which", ["exp2_sum", "exp2_below"])
def test_a_row_sum_does_not_depend_on_where_the_scratch_row_lies(which):
    """The compiled row pass's ``2^x`` and row sum, with the scratch row right after the
    scores (closer than LLVM's overlap check: its scalar loop) and far from them (its vector
    loop): the same bits. (The sum was added in the loop that stores the scratch row, whose
    two versions add in other orders.)"""
    numba = pytest.importorskip("numba", reason="the fast extra (numba) is not installed")
    from qkv import jit
    if jit.load(jit.ROWS) is None:
        pytest.skip("QKV_JIT=0: the compiled row pass is off")
    from qkv.kernels.rows import compiled as rc

    @numba.njit(fastmath=rc.FASTMATH)
    def exp2_sum_at(buf, n, gap, c):             # scores buf[:n], the scratch row `gap` entries after them
        e = buf[n + gap:2 * n + gap]
        return rc._exp2_sum(buf[:n], c, np.float32(0.0), e), e.copy()

    @numba.njit(fastmath=rc.FASTMATH)
    def exp2_below_at(buf, n, gap, c):           # the large-score path: exp(x - max) of stored scores
        e = buf[n + gap:2 * n + gap]
        return rc._exp2_below(buf[:n], np.float32(buf[:n].max()), e), e.copy()

    at = exp2_sum_at if which == "exp2_sum" else exp2_below_at

    rng = np.random.default_rng(0)
    for n in (9, 21, 40, 63):
        for trial in range(8):
            x = rng.standard_normal(n).astype(np.float32) * 4
            results = []
            for gap in (0, 2 * n + 64):          # 4·n bytes apart (< 256 for n < 64), and far
                buf = np.zeros(4 * n + 128, np.float32)
                buf[:n] = x
                results.append(at(buf, n, gap, np.float32(1.3)))
            (l0, e0), (l1, e1) = results
            assert e0.tobytes() == e1.tobytes(), f"n={n}: 2^x differs with the scratch row's place"
            assert np.float32(l0).tobytes() == np.float32(l1).tobytes(), \
                f"n={n}: the row sum differs with the scratch row's place: {l0!r} against {l1!r}"
