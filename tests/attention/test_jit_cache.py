"""The fast extra's kernel cache (qkv.jit_cache): one folder per qkv version, CPU and kernel source,
shared by every checkout; a one-line notice when (and only when) a kernel is compiled.

The subprocess tests compile one small kernel (the encoder's residual + LayerNorm) into a
temporary QKV_CACHE_DIR, so they take seconds, not the minutes of the whole set.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qkv import jit_cache

pytestmark = pytest.mark.slow  # subprocesses, mpiexec or compilers: the slow leg (pytest -m slow)

NOTICE = "qkv: compiling the fast kernels"
# one small kernel, checked against the formula in float64; prints the kernels this process compiled
SNIPPET = """
import numpy as np
from qkv import jit, jit_cache
rng = np.random.default_rng(0)
x = rng.standard_normal((5, 16)).astype(np.float32); a = rng.standard_normal((5, 16)).astype(np.float32)
g = np.linspace(0.5, 1.5, 16, dtype=np.float32); b = np.linspace(-1, 1, 16, dtype=np.float32)
out = np.empty_like(x)
jit.encoder().add_layer_norm(x, a, g, b, np.float32(1e-5), out)
h = x.astype(np.float64) + a
want = (h - h.mean(1, keepdims=True)) / np.sqrt(h.var(1, keepdims=True) + 1e-5) * g + b
assert np.abs(out - want).max() < 1e-4, np.abs(out - want).max()
print(sorted(jit_cache.compile_seconds()))
"""


def test_key_changes_with_version_cpu_features_source_and_numba():
    base = dict(version="0.1.0", cpu="znver4", features="+avx2,+avx512f", source="0123456789ab",
                numba_version="0.61.0", python="3.11")
    k = jit_cache.key(**base)
    assert k.startswith("0.1.0-znver4-") and k.endswith("-0123456789ab")
    for field, other in [("version", "0.2.0"), ("cpu", "haswell"), ("features", "+avx2,-avx512f"),
                         ("source", "ba9876543210"), ("numba_version", "0.62.0"), ("python", "3.12")]:
        assert jit_cache.key(**{**base, field: other}) != k, field
    assert re.fullmatch(r"[\w.+-]+", jit_cache.key(**{**base, "cpu": "x86 64/odd"}))   # one path component


def test_source_hash_covers_inlined_helpers(tmp_path):
    """A change in rows/compiled.py (inlined into rows/fused.py) gives a new cache folder, not a stale kernel."""
    files = {}
    for name, path in jit_cache.source_files().items():
        files[name] = tmp_path / name
        files[name].write_bytes(path.read_bytes())
    before = jit_cache.source_hash(files)
    assert before == jit_cache.source_hash()
    files["qkv.kernels.rows.compiled"].write_bytes(files["qkv.kernels.rows.compiled"].read_bytes() + b"\n# edit\n")
    assert jit_cache.source_hash(files) != before


def test_every_numba_module_is_in_the_source_hash():
    """A module that imports numba at its top is compiled code: it must be in COMPILED."""
    src = jit_cache.PACKAGE
    found = {".".join(("qkv",) + p.relative_to(src).with_suffix("").parts) for p in src.rglob("*.py")
             if re.search(r"^(import numba|from numba)", p.read_text(), re.M)}
    assert found == set(jit_cache.COMPILED)


def test_root_follows_qkv_cache_dir_then_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("QKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jit_cache.root() == tmp_path / "xdg" / "qkv"
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "mine"))
    assert jit_cache.root() == tmp_path / "mine"


numba = pytest.importorskip("numba", reason="the fast extra (numba) is not installed")


def _run(env_extra: dict, cwd: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "QKV_JIT", "QKV_CACHE_DIR")}
    env.update(env_extra)
    return subprocess.Popen([sys.executable, "-c", SNIPPET], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _done(proc) -> tuple[str, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return out, err


def _cached(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*.nbi"))


def test_notice_on_a_miss_only_and_the_cache_in_qkv_cache_dir(tmp_path):
    cache = tmp_path / "cache"
    out, err = _done(_run({"QKV_CACHE_DIR": str(cache)}, tmp_path))
    assert "add_layer_norm" in out and err.count(NOTICE) == 1 and len(err.strip().splitlines()) == 1
    (folder,) = (cache / "numba").iterdir()
    assert folder.name.endswith(jit_cache.source_hash()) and (folder / "qkv.models.compiled").is_dir()
    assert any(n.startswith("compiled.add_layer_norm") for n in _cached(folder))
    out, err = _done(_run({"QKV_CACHE_DIR": str(cache)}, tmp_path))   # loaded: nothing compiled, nothing said
    assert out.strip() == "[]" and NOTICE not in err


def test_no_notice_and_no_cache_without_the_jit(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(QKV_JIT="0", QKV_CACHE_DIR=str(tmp_path / "cache"))
    code = "import numpy as np, qkv; q = np.ones((1, 1, 8, 4), np.float32); qkv.attention(q, q, q, causal=True)"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert NOTICE not in res.stderr and not (tmp_path / "cache").exists()


def test_two_processes_compiling_at_once_into_an_empty_cache(tmp_path):
    """Both compute right (the snippet checks its result); each either compiled (and said so)
    or, where the other had already written the kernel when it looked, loaded it without a
    word: which one is a matter of timing, on a slow or busy machine the second process
    starts late. At least one compiled, and a third process loads what they left."""
    cache = str(tmp_path / "cache")
    procs = [_run({"QKV_CACHE_DIR": cache}, tmp_path) for _ in range(2)]
    compiled = []
    for out, err in map(_done, procs):
        compiled.append("add_layer_norm" in out)
        assert (NOTICE in err) == compiled[-1] and (compiled[-1] or out.strip() == "[]"), (out, err)
    assert any(compiled)
    assert not list(Path(cache).rglob("*.tmp.*"))                        # no half-written file left
    out, err = _done(_run({"QKV_CACHE_DIR": cache}, tmp_path))
    assert out.strip() == "[]" and NOTICE not in err


def test_users_numba_cache_dir_wins(tmp_path):
    """NUMBA_CACHE_DIR set (CI's AVX2 leg sets it): numba's own layout there, nothing in qkv's folder."""
    mine, qkvs = tmp_path / "numba-mine", tmp_path / "qkv-cache"
    out, err = _done(_run({"NUMBA_CACHE_DIR": str(mine), "QKV_CACHE_DIR": str(qkvs)}, tmp_path))
    assert "add_layer_norm" in out and NOTICE in err and str(mine) in err
    assert any(n.startswith("compiled.add_layer_norm") for n in _cached(mine))
    assert not (qkvs / "numba").exists()


def test_cold_suite_quick(tmp_path, capsys):
    """`qkv bench --quick --suite cold`: the job compiled in its cold process, loaded in its warm one."""
    import json

    from qkv import cli

    out = tmp_path / "r.json"
    assert cli.main(["bench", "--quick", "--suite", "cold", "--no-torch", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    (row,) = json.loads(out.read_text())["cold"]
    assert row["job"] == "layernorm" and "first call: cold" in text
    assert row["cold"]["notice"] and not row["warm"]["notice"]
    assert list(row["cold"]["compiled"]) == ["qkv.models.compiled.add_layer_norm"] and row["warm"]["compiled"] == {}
    assert row["cold"]["cpu_s"] > 0 and row["warm"]["wall_s"] > 0


def test_compiled_at_first_call_compiles_once_at_the_first_call():
    """The row kernel's forward and backward are made at their first call (a forward-only job never
    compiles the backward); threads calling at once share one compile."""
    import threading

    from numba.core import event, types

    from qkv.kernels.rows.fused import compiled_at_first_call

    seen = []

    class Count(event.Listener):
        def on_start(self, ev):
            seen.append(ev.data["dispatcher"].py_func.__name__)

        def on_end(self, ev):
            pass

    with event.install_listener("numba:compile", Count()):
        @compiled_at_first_call(types.float64(types.float64), nogil=True)
        def twice(x):
            return 2.0 * x

        assert seen == [] and twice.__name__ == "twice"            # decorated: nothing compiled yet
        results = []
        threads = [threading.Thread(target=lambda: results.append(twice(3.0))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert twice(1.5) == 3.0
    assert results == [6.0] * 4 and seen == ["twice"]              # one compile, for every caller


def test_a_forward_compiles_the_row_kernels_forward_once_and_no_backward(tmp_path):
    """The row kernel's per-head function gets one signature (its parallel loop's index was
    uint64 where numba typed it int64: two compiles, 20-50 s of CPU each), and only the case
    called (no softcap, no dropout: the four cases in one kernel cost four times as much); a
    forward-only job leaves the backward uncompiled. About 10 s of CPU."""
    import pickle

    code = ("import numpy as np, qkv; q = np.ones((1, 2, 32, 16), np.float32); "
            "qkv.attention(q, q, q, causal=True)")          # auto: the row kernel, with numba
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "QKV_JIT")}
    env["QKV_CACHE_DIR"] = str(tmp_path)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    (folder,) = (tmp_path / "numba").glob("*/qkv.kernels.rows.fused")
    index = {p.name.split("-")[0]: p for p in folder.glob("*.nbi")}
    assert "fused._forward_kernel.locals.forward" in index and "fused._forward_head" in index
    assert "fused._backward_kernel.locals.backward" not in index and "fused._backward_group" not in index
    for name in ("fused._forward_kernel.locals.forward", "fused._forward_head"):
        with open(index[name], "rb") as f:
            pickle.load(f)                               # numba's version
            _, overloads = pickle.loads(f.read())
        assert len(overloads) == 1, name                 # one case (the entry's closure constants), one signature
    (args, *_), = overloads                              # the head's last: its (capped, drop) the plain case
    assert [str(t) for t in args[-3:-1]] == ["Literal[bool](False)"] * 2
