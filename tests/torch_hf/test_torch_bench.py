"""benchmarks/torch_suite.py (``qkv bench --suite torch``): the three methods compute the same
thing in every case, measure() returns its rows, the peak-memory child works."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch suite needs PyTorch: pip install -e '.[torch]'")
suite = pytest.importorskip("qkv_benchmarks.torch_suite", reason="the benchmarks ship as qkv_benchmarks")


@pytest.mark.parametrize("case", sorted(suite.QUICK))
def test_every_method_computes_the_same_attention(case):
    # the SDPA mask of each case must be the pattern qkv gets as options
    size = suite.QUICK[case]
    outs = {m: suite.runner(m, "forward", case, size)() for m in suite.METHODS}
    ref = outs["sdpa"].numpy()
    for m in ("qkv.torch", "qkv"):
        got = outs[m].numpy() if isinstance(outs[m], torch.Tensor) else outs[m]
        np.testing.assert_allclose(got, ref, atol=2e-5, err_msg=m)
    grads = {m: suite.runner(m, "forward+backward", case, size)() for m in ("qkv.torch", "sdpa")}
    for a, b in zip(grads["qkv.torch"], grads["sdpa"]):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-4)


def test_measure_quick_rows_and_table():
    labels = []
    rows = suite.measure(1, True, progress=labels.append, memory=False)
    assert [(r["case"], r["pass"]) for r in rows] == [(c, p) for c in suite.QUICK for p in suite.PASSES]
    assert labels and all(set(r["seconds"]) == set(suite.METHODS) for r in rows)
    assert all(r["vs_sdpa"] > 0 and r["wrapper"] > 0 for r in rows)
    assert suite.paired_ratio({"a": [2.0, 9.0, 3.0], "b": [1.0, 3.0, 3.0]}, "a", "b") == 2.0
    assert "gflops" in rows[0] and rows[0]["peak_mib"] is None
    table = suite.format_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| window" in table


@pytest.mark.slow
def test_peak_memory_child_reports_mebibytes():
    size = dict(b=1, h=2, t=512, d=32, window=64)
    peak = suite.peak_memory("qkv.torch", "forward+backward", "window", size, threads=1)
    assert peak is not None and 0 <= peak < 512
