"""`qkv bench --suite hf-hybrid --quick`: every kind, shape and pass measured on both sides, each
row with its keys (no timing asserted)."""
import json

import pytest

from qkv import cli

pytest.importorskip("torch")
pytest.importorskip("transformers")

KEYS = {"family": str, "shape": str, "what": str, "qkv_s": float, "peer_s": float, "ratio": float,
        "served": list, "missing": list}


def test_quick_rows(tmp_path):
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
