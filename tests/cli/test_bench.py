"""`qkv bench --quick` end to end: the header, the tables have their rows and their numbers parse.

No timing is asserted: speed claims live in the benchmark's output, not in tests.
"""
import contextlib
import json
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("rich", reason="qkv bench needs the cli extra (rich)")

import qkv  # noqa: E402
from qkv import cli, jit  # noqa: E402
from qkv.kernels.rows import kernel as rows_kernel  # noqa: E402
from qkv_benchmarks import attention as bench  # noqa: E402
from qkv_benchmarks.machine import vector_level  # noqa: E402
from qkv_benchmarks.suites import QUICK, SMOKE_NOTE  # noqa: E402

NUM = r"(\d+\.\d+|—)"


def _rows(text, first):
    """Table rows whose first cell is ``first``, split into cells."""
    return [line.split() for line in text.splitlines() if line.split()[:1] == [first]]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "qkv", "bench", "--quick", "--json", str(out / "r.json")]
    try:
        import matplotlib  # noqa: F401
        cmd += ["--plot", str(out / "sweep.png")]
    except ImportError:
        pass
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout, json.loads((out / "r.json").read_text()), out


@pytest.mark.slow
def test_header_says_where_the_numbers_come_from(quick_run):
    text, data, _ = quick_run
    (line,) = [x for x in text.splitlines() if x.startswith("machine: ")]
    m = data["machine"]
    assert m["vector"] == vector_level() in ("AVX-512", "AVX2", "SVE", "NEON", "SSE4.2", "baseline")
    assert f"NumPy vector level {m['vector']} " in line
    from qkv.kernels.flash import exp2

    assert f"qkv exp path: {exp2.path()}" in line and m["exp"] == exp2.path()
    if m["blas"].get("kernel"):  # threadpoolctl found NumPy's BLAS
        assert f"kernel {m['blas']['kernel']}" in line and m["blas"]["library"] in line
    if data["torch"]:
        assert f"torch {data['torch']} ({m['torch_capability']})" in line
    assert set(m["numpy_simd"]) == {"baseline", "found", "not_found"}


def test_quick_run_says_it_is_a_smoke_test(quick_run):
    text, data, _ = quick_run
    assert f"note: {SMOKE_NOTE}" in text and data["quick"] and data["note"] == SMOKE_NOTE
    assert text.count("(smoke-test sizes)") == 4     # every table's title says so (main, options, sweep, decode)
    assert data["repeats"] == QUICK["repeats"]


def test_main_table_has_every_case(quick_run):
    text, data, _ = quick_run
    s = QUICK["main"]
    assert f"attention B={s['b']} H={s['h']} T={s['t']} D={s['d']} float32" in text
    cases = {}
    for line in text.splitlines():
        m = re.match(r"\s*(fwd\+bwd|fwd) (full|causal)\s+" + r"\s+".join([NUM] * 9) + r"\s*$", line)
        if m:
            cases[m.group(1) + " " + m.group(2)] = m.groups()[2:]
    assert set(cases) == {"fwd full", "fwd causal", "fwd+bwd full", "fwd+bwd causal"}, text
    assert [r["case"] for r in data["main"]] == ["fwd full", "fwd causal", "fwd+bwd full", "fwd+bwd causal"]
    for r in data["main"]:
        cells, sec = cases[r["case"]], r["seconds"]
        assert sec["qkv"] > 0 and sec["dense"] > 0 and r["flop"] > 0
        # the table shows the JSON's numbers: seconds, and GFLOP/s = FLOP / seconds
        assert cells[0] == f"{sec['qkv']:.4f}" and cells[1] == f"{sec['dense']:.4f}"
        assert cells[3] == f"{r['flop'] / sec['qkv'] / 1e9:.1f}"
        assert sec["products"] > 0 and cells[7] == f"{sec['products']:.4f}"  # the products-only bound ran
        if "torch" in sec:
            assert cells[6] == f"{sec['torch'] / sec['qkv']:.2f}"
            assert cells[8] == f"{sec['torch'] / sec['products']:.2f}"
        else:
            assert cells[2] == cells[6] == cells[8] == "—"


def test_sweep_table_has_time_and_memory(quick_run):
    text, data, out = quick_run
    ts = QUICK["sweep"]["ts"]
    assert [r["t"] for r in data["sweep"]] == list(ts)
    for r in data["sweep"]:
        (row,) = _rows(text, str(r["t"]))
        assert row[1] == f"{r['seconds']['qkv']:.4f}" and row[2] == f"{r['seconds']['dense']:.4f}"
        assert set(r["peak"]) == {"qkv", "dense"}                  # torch's memory: not in a quick run
        assert row[4] == f"{r['peak']['qkv']['extra_bytes'] / 2 ** 20:.1f}" and row[6] == "—"
        assert all(p["extra_bytes"] >= 0 and p["how"] for p in r["peak"].values())
    # a larger call needs more memory: each size was measured, not one figure copied
    peaks = [r["peak"]["dense"]["extra_bytes"] for r in data["sweep"]]
    assert peaks[-1] > peaks[0]
    if (out / "sweep.png").exists():
        assert (out / "sweep.png").stat().st_size > 1000


def test_decode_table_reports_bandwidth(quick_run):
    text, data, _ = quick_run
    (row,) = _rows(text, "decode")
    assert len(row) == 9
    r, c = data["decode"][0], QUICK["decode"]
    assert r["bytes"] == c["hkv"] * c["tk"] * (c["d"] + c["d"]) * 4
    assert row[4] == f"{r['bytes'] / r['seconds']['qkv'] / 1e9:.1f}"     # qkv GB/s
    copied = r["copy_bytes_per_s"] / 2e9                                  # STREAM counts read + written
    assert row[7] == f"{copied:.1f}" and r["copy_bytes_per_s"] > 0
    assert abs(float(row[8]) - r["bytes"] / r["seconds"]["qkv"] / 1e9 / copied) <= 0.005  # reads ÷ copied
    assert "read + written" in text


def test_flop_formulas():
    assert bench.forward_flops(1, 8, 4096, 4096, 64, False) == 4 * 8 * 4096 * 4096 * 64
    assert bench.forward_flops(1, 8, 4096, 4096, 64, True) == 2 * 8 * 4096 * 4096 * 64
    assert bench.fwd_bwd_flops(2, 1, 3, 5, 7, False) == 3.5 * 4 * 2 * 3 * 5 * 7
    assert bench.kv_bytes(1, 8, 32768, 128, 128) == 8 * 32768 * 256 * 4


def test_missing_rich_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich", None)
    assert cli.main(["bench", "--quick", "--suite", "decode"]) == 2
    assert "pip install -e '.[cli]'" in capsys.readouterr().err


def test_bad_options_are_refused(capsys):
    assert cli.main(["bench", "--quick", "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err
    assert cli.main(["bench", "--quick", "--threads", "-1"]) == 2
    assert "--threads" in capsys.readouterr().err
    assert cli.main(["bench", "--quick", "--json", "/nonexistent-folder/r.json"]) == 2
    assert "--json must be in an existing folder" in capsys.readouterr().err


@pytest.mark.slow
def test_encoder_suite_runs_against_sentence_transformers(tmp_path, capsys):
    pytest.importorskip("sentence_transformers", reason="the encoder suite needs the test extra")
    models = pytest.importorskip("qkv.models")
    try:
        models.default_model_path()
    except Exception as err:  # the checkpoint package is the models extra
        pytest.skip(f"all-MiniLM-L6-v2 is not installed: {err}")
    out = tmp_path / "enc.json"
    assert cli.main(["bench", "--quick", "--suite", "encoder", "--no-torch", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ratio = sentence-transformers time / qkv time" in text
    data = json.loads(out.read_text())
    assert [r["workload"] for r in data["encoder"]] == ["short", "long"]
    for row in data["encoder"]:
        assert row["qkv_s"] > 0 and row["st_s"] > 0 and row["ratio"] > 0
        assert row["max_abs_err"] < 1e-4  # the two encoders agree on what they timed
    assert data["encoder"][1]["tokens"] == 2 * 512
    assert _rows(text, "long") and float(_rows(text, "long")[0][-3]) > 0  # the table's ratio cell


# --- qkv bench --suite torch -------------------------------------------------------------

def test_torch_suite_runs_from_the_command_line(tmp_path, capsys, monkeypatch):
    """`qkv bench --quick --suite torch`: a smoke run of every case and pass; the JSON has its
    rows and the table shows them; the progress bar is told of every step it counted."""
    pytest.importorskip("torch", reason="the torch suite needs PyTorch: pip install -e '.[torch]'")
    from qkv.cli import bench as bench_cli
    from qkv_benchmarks import torch_suite

    told = {}

    @contextlib.contextmanager
    def recording_bar(label, total, *fields, **kw):
        told["total"], told["advanced"] = total, 0

        def update(advance=1, **values):
            told["advanced"] += advance
        yield update
    monkeypatch.setattr(bench_cli, "progress_bar", recording_bar)
    out = tmp_path / "t.json"
    assert cli.main(["bench", "--quick", "--suite", "torch", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert told["advanced"] == told["total"] == 3 * 2          # 3 cases x 2 passes, no memory when quick
    assert data["main"] == [] and data["skipped"] == {}
    rows = data["torch_suite"]
    assert [(r["case"], r["pass"]) for r in rows] == [(c, p) for c in torch_suite.QUICK for p in torch_suite.PASSES]
    assert "qkv.torch.attention against qkv on NumPy and PyTorch SDPA" in text and "(smoke-test sizes)" in text
    lines = [x.split() for x in text.splitlines() if re.search(r"\s(forward|forward\+backward)\s+\d+\.\d{3}\s", x)]
    assert len(lines) == len(rows)
    for cells, r in zip(lines, rows):                          # the table shows the JSON's numbers, in order
        assert set(r["seconds"]) == set(torch_suite.METHODS) and r["wrapper"] > 0 and r["vs_sdpa"] > 0
        assert cells[-7:-1] == [r["pass"], *(f"{r['seconds'][m]:.3f}" for m in torch_suite.METHODS),
                                f"{r['wrapper']:.2f}", f"{r['vs_sdpa']:.2f}"]
        assert cells[-1] == "—"                                # no peak memory in a quick run


def test_a_suite_without_its_extra_is_skipped_with_the_reason(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)          # as if the mpi extra were not installed
    out = tmp_path / "s.json"
    assert cli.main(["bench", "--quick", "--suite", "torch", "--suite", "ring", "--no-torch", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    skipped = json.loads(out.read_text())["skipped"]
    assert skipped["torch"] == "PyTorch was left out (torch=False, --no-torch)"
    assert "Error: import of mpi4py halted" in skipped["ring"] and skipped["ring"].endswith("(it needs: pip install -e '.[mpi]')")
    assert f"torch suite skipped: {skipped['torch']}" in text and f"ring suite skipped: {skipped['ring']}" in text


def test_under_mpiexec_only_the_ring_suite_runs(monkeypatch, capsys):
    monkeypatch.setenv("PMI_SIZE", "2")                       # what MPICH's mpiexec sets in each rank
    assert cli.main(["bench", "--quick", "--suite", "main"]) == 2
    assert "under mpiexec only --suite ring runs" in capsys.readouterr().err


@pytest.mark.parametrize("causal", [False, True])
def test_products_bound_runs_the_kernels_products_over_the_visible_keys(causal):
    """The products-only forward covers each score of qkv's tiles once: its unnormalised
    output is (Q Kᵀ) V over those keys: all of them, or causal up to the end of the row's
    128-row diagonal piece (the kernel masks inside the piece; T a multiple of no tile)."""
    import threading
    from qkv_benchmarks import products
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 1300, 8)).astype(np.float32) for _ in range(3))
    jobs, out = products._forward_jobs(q, k, v, causal, threading.local())
    for job in jobs:
        job()
    s = q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2)
    if causal:
        rows, keys = np.arange(1300)[:, None], np.arange(1300)[None, :]
        s = np.where(keys < np.minimum((rows // products.DIAGONAL + 1) * products.DIAGONAL, 1300), s, 0)
    np.testing.assert_allclose(out, s @ v, rtol=1e-4, atol=1e-3)
    products.runner(q, k, v, q, causal=causal, backward=True, threads=2)()  # and the backward runs


# --- qkv bench --suite shapes ------------------------------------------------------------

def test_shapes_suite_runs_from_the_command_line(tmp_path, capsys):
    """`qkv bench --quick --suite shapes`: every shape, mask and pass has a row with its keys,
    and the table shows the JSON's ratio."""
    pytest.importorskip("torch", reason="the shapes suite needs PyTorch: pip install -e '.[torch]'")
    from qkv_benchmarks import shapes_suite

    out = tmp_path / "s.json"
    assert cli.main(["bench", "--quick", "--suite", "shapes", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    rows = data["shapes"]
    assert data["main"] == [] and data["skipped"] == {}
    assert [(tuple(r["shape"]), r["causal"], r["pass"]) for r in rows] == shapes_suite.cases(quick=True)
    assert {r["pass"] for r in rows} == {"fwd", "fwd+bwd"}
    for r in rows:
        assert {"shape", "causal", "pass", "qkv_s", "torch_s"} <= set(r)
        assert r["qkv_s"] > 0 and r["torch_s"] > 0 and r["ratio"] > 0
        assert r["flop"] == shapes_suite.flops(tuple(r["shape"]), r["causal"], r["pass"])
        if rows_kernel._fused() is not None:    # the fast extra: the products-only side ran
            assert 0 < r["products_s"] and r["bound"] > 0
        else:
            assert r["products_s"] is None and r["bound"] is None
    assert "training and serving shapes" in text and "(smoke-test sizes)" in text
    lines = [x.split() for x in text.splitlines() if re.match(r"\s*\(\d+,\d+,\d+,\d+\)\s", x)]
    assert [cells[-1] for cells in lines] == [f"{r['ratio']:.2f}" for r in rows]


def test_products_only_frees_the_row_passes_for_one_call_and_puts_them_back():
    from qkv_benchmarks import shapes_suite
    if rows_kernel._fused() is None:
        assert shapes_suite.products_only(lambda: None) is None
        return
    real = jit.load(jit.ROWS_FUSED)
    q = np.random.default_rng(0).standard_normal((2, 2, 16, 8)).astype(np.float32)
    seen = []

    def call():
        seen.append(jit.load(jit.ROWS_FUSED))
        out = qkv.attention(q, q, q, causal=True)
        raise RuntimeError(float(np.abs(out - qkv.attention(q, q, q, causal=True, method="reference")).max()))

    with pytest.raises(RuntimeError) as err:
        shapes_suite.products_only(call)()
    assert float(str(err.value)) > 1e-3                 # the passes were left out: not attention's result
    assert isinstance(seen[0], shapes_suite._Free) and jit.load(jit.ROWS_FUSED) is real


def test_shapes_suite_without_torch_is_skipped(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert cli.main(["bench", "--quick", "--suite", "shapes", "--no-torch", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["skipped"]["shapes"] == "PyTorch was left out (torch=False, --no-torch)"


# --- qkv bench --suite hf ----------------------------------------------------------------

def test_hf_suite_runs_from_the_command_line(tmp_path, capsys):
    """`qkv bench --quick --suite hf --threads 1`: a row per model and pass with the three
    implementations' times, one-thread CPU times, and the table shows the JSON's ratios."""
    pytest.importorskip("torch", reason="the hf suite needs PyTorch: pip install -e '.[hf]'")
    pytest.importorskip("transformers", reason="the hf suite needs transformers: pip install -e '.[hf]'")
    from qkv_benchmarks import hf_suite

    out = tmp_path / "h.json"
    assert cli.main(["bench", "--quick", "--suite", "hf", "--threads", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    rows = data["hf"]
    assert data["main"] == [] and data["skipped"] == {}
    assert [(r["family"], r["pass"]) for r in rows] == hf_suite.cases(quick=True)
    for r in rows:
        assert set(r["wall_s"]) == set(r["thread_cpu_s"]) == set(hf_suite.IMPLS) and r["threads"] == 1
        assert all(s > 0 for s in r["wall_s"].values()) and r["qkv_vs_sdpa"] > 0 and r["qkv_vs_eager"] > 0
    flat = " ".join(text.split())  # the title may wrap
    assert "attn_implementation qkv against sdpa and eager" in flat and "CPU time of the one thread" in flat
    lines = [x.split() for x in text.splitlines() if x.split()[:1] in (["llama"], ["gpt2"])]
    assert [cells[5] for cells in lines] == [f"{r['qkv_vs_sdpa']:.3f}" for r in rows]


def test_hf_suite_without_torch_is_skipped(tmp_path):
    out = tmp_path / "h.json"
    assert cli.main(["bench", "--quick", "--suite", "hf", "--no-torch", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["skipped"]["hf"] == "PyTorch was left out (torch=False, --no-torch)"
