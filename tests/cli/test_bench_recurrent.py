"""`qkv bench --suite recurrent`: the quick plan on tiny shapes runs end to end, every row
has its keys, and the table shows the JSON's ratios (no timing asserts)."""
import json

import pytest

from qkv import cli

KEYS = {"kernel", "group", "shape", "pass", "qkv_s", "peer_s", "ratio", "peer", "products_s", "bound"}


@pytest.fixture
def tiny(monkeypatch):
    from qkv_benchmarks import recurrent_suite
    monkeypatch.setitem(recurrent_suite.QUICK, "decay", ((1, 2, 70, 8),))
    monkeypatch.setitem(recurrent_suite.QUICK, "gla", ((1, 1, 9, 4),))
    monkeypatch.setitem(recurrent_suite.QUICK, "delta", ((1, 1, 9, 4),))
    monkeypatch.setitem(recurrent_suite.QUICK, "growth", dict(b=1, h=1, d=8, ts=(64, 128)))
    monkeypatch.setitem(recurrent_suite.QUICK, "decode", dict(b=1, h=1, d=8, ls=(16, 64)))
    return recurrent_suite


def test_recurrent_suite_runs_from_the_command_line(tiny, tmp_path, capsys):
    pytest.importorskip("torch", reason="the recurrent suite's peers need PyTorch")
    if tiny.peer_missing():
        pytest.skip(tiny.peer_missing())
    out = tmp_path / "r.json"
    assert cli.main(["bench", "--quick", "--suite", "recurrent", "--threads", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    rows = data["recurrent"]
    assert data["skipped"] == {} and data["main"] == []
    assert len(rows) == tiny.steps(quick=True)
    kernel_rows = [r for r in rows if r["group"] == "kernel"]
    assert [(r["kernel"], tuple(r["shape"]), r["pass"]) for r in kernel_rows] == tiny.cases(quick=True)
    for r in rows:
        assert KEYS <= set(r)
        assert r["qkv_s"] > 0 and r["peer_s"] > 0 and r["ratio"] > 0
        assert (r["products_s"] is not None) == (r["kernel"] == "decay")
    growth = [r for r in rows if r["group"] == "growth"]
    assert [r["shape"][2] for r in growth] == [64, 128]
    assert all(isinstance(r["slope_qkv"], float) and isinstance(r["slope_peer"], float) for r in growth)
    assert [r["shape"][2] for r in rows if r["kernel"] == "decode"] == [16, 64]
    layers = [(r["kernel"], r["pass"]) for r in rows if r["group"] == "layer"]
    assert layers == [(k, p) for k in ("mamba2", "gated_delta") for p in ("fwd", "fwd+bwd")]
    assert "recurrences: qkv.recurrent against torch chunk forms" in text and "log-log slope" in text
    names = (["decay"], ["gla"], ["delta"], ["decode"], ["mamba2"], ["gated_delta"])
    shown = [line.split()[-1] for line in text.splitlines() if line.split()[:1] in names]
    assert shown == [f"{r['ratio']:.2f}" for r in rows]


def test_recurrent_suite_without_torch_is_skipped(tmp_path):
    out = tmp_path / "r.json"
    assert cli.main(["bench", "--quick", "--suite", "recurrent", "--no-torch", "--json", str(out)]) == 0
    skipped = json.loads(out.read_text())["skipped"]["recurrent"]
    assert "PyTorch was left out" in skipped or "not installed" in skipped


def test_the_products_bound_runs_the_chunked_forms_products():
    import numpy as np
    from qkv_benchmarks.recurrent_suite import decay_products
    q = np.random.default_rng(0).standard_normal((1, 2, 100, 8)).astype(np.float32)
    decay_products(q, q, q, q, backward=True, chunk=16)()


def test_growth_slopes_are_taken_within_rounds(tiny, monkeypatch):
    """Every round times every T; a host whose speed swings between rounds (here 1x to 8x)
    leaves each round's slope, and so their median, at the work's own slope (here 1)."""
    pytest.importorskip("torch", reason="the growth rows' peer needs PyTorch")
    if tiny.peer_missing():
        pytest.skip(tiny.peer_missing())
    import numpy as np
    ts, drift = (64, 128, 256), (1.0, 8.0, 2.0, 5.0, 1.5)
    seen = {}

    def fake_rounds(fns, repeats, rotate):
        seen["names"] = sorted(fns)
        return {m: [(drift[r] * int(m.split("@")[1]) * (2.0 if m.startswith("peer") else 1.0), 0.0)
                    for r in range(repeats)] for m in fns}
    monkeypatch.setattr(tiny, "rounds", fake_rounds)
    rows = tiny._growth_rows(np.random.default_rng(0), dict(b=1, h=1, d=8, ts=ts), len(drift), lambda label: None)
    assert seen["names"] == sorted(f"{s}@{t}" for s in ("qkv", "peer", "products") for t in ts)
    assert [r["shape"][2] for r in rows] == list(ts)
    for r in rows:
        assert r["slope_qkv"] == pytest.approx(1.0) and r["slope_peer"] == pytest.approx(1.0)
        assert r["ratio"] == pytest.approx(2.0) and r["qkv_s"] == pytest.approx(2.0 * r["shape"][2])
