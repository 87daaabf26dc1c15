"""`qkv bench --suite hf-hybrid --quick`: every kind, shape and pass measured on both sides, each
row with its keys (no timing asserted)."""
import json

import pytest

from qkv import cli

pytest.importorskip("torch")
pytest.importorskip("transformers")

KEYS = {"family": str, "shape": str, "what": str, "qkv_s": float, "peer_s": float, "ratio": float,
        "peer_kernel_s": float, "bound": float, "qkv_kernel_s": float, "kernel_ratio": float, "served": list, "missing": list,
        "peer_rest_s": float, "qkv_rest_s": float, "repeats": int}


def test_quick_rows(tmp_path, capsys):
    from qkv_benchmarks import hf_hybrid_suite as suite

    out = tmp_path / "h.json"
    assert cli.main(["bench", "--quick", "--threads", "1", "--json", str(out), "--suite", "hf-hybrid"]) == 0
    data = json.loads(out.read_text())
    rows = data["hf_hybrid"]
    assert data["skipped"].get("hf-hybrid") is None
    assert len(rows) == suite.count(quick=True)
    assert [(r["family"], r["what"]) for r in rows] == [(k, w) for k in suite.KINDS for w in suite.WHATS]
    for r in rows:
        for key, kind in KEYS.items():
            assert isinstance(r[key], kind), (key, r[key])
        assert r["qkv_s"] > 0 and r["peer_s"] > 0 and "T=32" in r["shape"]
        assert sorted(r["served"] + r["missing"]) == sorted(set(r["served"] + r["missing"])) and r["served"] + r["missing"]
        assert 0 < r["peer_kernel_s"] <= r["peer_s"] and r["bound"] >= 1
        assert 0 < r["qkv_kernel_s"] <= r["qkv_s"] and r["kernel_ratio"] == r["peer_kernel_s"] / r["qkv_kernel_s"]
        assert 0 < r["peer_rest_s"] <= r["peer_s"] and r["bound"] == r["peer_s"] / r["peer_rest_s"]
        assert 0 < r["qkv_rest_s"] <= r["qkv_s"]
        assert r["repeats"] == (suite.DECODE_TIMES if r["what"] == "decode" else 1)   # --repeats 1 (quick)
    table = capsys.readouterr().out
    assert "transformers' hybrids" in table and "peer in kernels" in table and "kernels: peer ÷ qkv" in table
    assert "of the bound" in table and "in its timed calls themselves" in table
    assert f"medians of 1 (decoding rows: of {suite.DECODE_TIMES})" in suite.table(rows, data["repeats"], 1).title
    old = [{k: v for k, v in r.items() if k not in ("repeats", "peer_rest_s", "qkv_rest_s")} for r in rows]
    rendered = suite.table(old, 3, 1)                                # a record made before either field
    assert "decoding rows" not in rendered.title and "in one more call after the timed ones" in rendered.notes[0]


def test_each_timed_call_clocks_its_own_time_inside_the_replaced_functions():
    """Each side returns the seconds its call spent inside the modeling module's replaceable
    functions (served by qkv or not), so the bound comes from the calls the wall clock timed: the
    time outside them is not counted, a function called from inside another is counted once, and
    every wrapped name is restored afterwards."""
    import importlib
    import time

    import torch

    from qkv_benchmarks import hf_hybrid_suite as suite
    from qkv_benchmarks.timing import rounds
    from qkv.torch import hf_recurrent

    module = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    names = {a: o for a, o in vars(module).items() if hf_recurrent.kernel_name(o)}
    assert "torch_chunk_gated_delta_rule" in names
    x, w = torch.zeros(1, 4, 8), torch.zeros(4, 3)
    seen = []

    def call():
        time.sleep(0.05)                                             # outside the kernels
        seen.append(getattr(module.causal_conv1d_fn, "__wrapped__", None) is not None)
        module.causal_conv1d_fn(x, w)                                # inside: a few ms at most

    with suite._switch(module) as use:
        slow = module.torch_chunk_gated_delta_rule
        returns = {}
        runs = rounds(suite._sides(use, call), 3, rewarm_below=0, returns=returns)
        assert set(returns) == {"qkv", "peer"} and all(len(v) == 3 for v in returns.values())
        for side in ("qkv", "peer"):
            for (wall, _), spent in zip(runs[side], returns[side]):
                assert 0 < spent < 0.05 < wall                        # the sleep is outside
        assert all(seen)
        assert slow is not names["torch_chunk_gated_delta_rule"]     # a function qkv may not serve: clocked too
    assert {a: getattr(module, a) for a in names} == names          # transformers' functions back


def test_a_call_inside_another_is_counted_once(monkeypatch):
    """Where one replaceable function calls another through the module, the outer call's seconds
    are the time inside (the inner one is not added again)."""
    import importlib
    import time

    from qkv_benchmarks import hf_hybrid_suite as suite

    module = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")

    def outer(*a, **k):
        time.sleep(0.01)
        return module.causal_conv1d_update()

    def inner(*a, **k):
        time.sleep(0.05)
    outer.kernel_layer_name, inner.kernel_layer_name = "chunk_gated_delta_rule", "causal_conv1d_update"
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", outer)
    monkeypatch.setattr(module, "causal_conv1d_update", inner)
    with suite._switch(module) as use:
        spent = suite._sides(use, lambda: module.torch_chunk_gated_delta_rule())["peer"]()
    assert 0.06 <= spent < 0.1                                        # counted twice: 0.11


def test_split_takes_each_calls_rest():
    from qkv_benchmarks import hf_hybrid_suite as suite

    wall, inside, rest = suite.split([(1.0, 0), (3.0, 0), (2.0, 0)], [0.9, 0.5, 1.5])
    assert (wall, inside, rest) == (2.0, 0.9, 0.5)                   # rests 0.1, 2.5, 0.5: their median


def test_the_sides_switch_functions_without_patching_inside_the_clock(monkeypatch):
    """_switch: one module patched for the whole timing; each side says which functions serve
    (qkv's or transformers'), and transformers' are back afterwards."""
    import functools
    import importlib

    import torch

    from qkv_benchmarks import hf_hybrid_suite as suite
    from qkv.torch import hf_kernels, hf_recurrent

    # Which side served each call, by a spy on qkv's function (the two sides' float64 sums may
    # round alike on one CPU and apart on another, so the results alone cannot tell them apart).
    served = []
    qkv_conv = hf_kernels.causal_conv1d_fn

    @functools.wraps(qkv_conv)
    def spy(*args, **kwargs):
        served.append(True)
        return qkv_conv(*args, **kwargs)
    monkeypatch.setattr(hf_kernels, "causal_conv1d_fn", spy)

    module = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    before = dict(vars(module))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 4, 8, dtype=torch.float64, generator=g), torch.randn(4, 3, dtype=torch.float64, generator=g)
    hf_recurrent.patch_module(module)
    want_qkv = module.causal_conv1d_fn(x, w)
    hf_recurrent.unpatch_module(module)
    want_peer = module.causal_conv1d_fn(x, w)
    calls = []
    with suite._switch(module) as use:
        def call():
            served.clear()
            out = module.causal_conv1d_fn(x, w)
            calls.append((out, bool(served)))
        sides = suite._sides(use, call)
        sides["qkv"](), sides["peer"](), sides["qkv"]()
        assert module.causal_conv1d_fn is not before["causal_conv1d_fn"]
    assert [by_qkv for _, by_qkv in calls] == [True, False, True]
    assert torch.equal(calls[0][0], want_qkv) and torch.equal(calls[2][0], want_qkv)
    assert torch.equal(calls[1][0], want_peer)
    assert dict(vars(module)) == before and not hf_recurrent.served(module)
