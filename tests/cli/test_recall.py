"""qkv experiment recall: the lookup task learned by softmax and by linear attention."""
import json

import numpy as np
import pytest

import qkv
from qkv.cli import main
from qkv.experiments import recall
from qkv.experiments.lookup import LookupConfig, train_lookup
from qkv.experiments.recall import RecallConfig, recall_experiment

TINY = dict(pairs=(2, 4), n_keys=8, n_values=4, d_model=8, steps=40, batch=32, n_eval=200)


def test_the_record_has_the_issue_shape():
    calls = []
    rec = recall_experiment(RecallConfig(**TINY), progress=lambda *a: calls.append(a))
    json.dumps(rec)
    assert rec["pairs"] == [2, 4]
    for m in ("softmax", "linear"):
        assert len(rec[m]) == 2 and all(0.0 <= a <= 1.0 for a in rec[m])
        assert len(rec["attention_on_key"][m]) == 2
    assert rec["chance"] == 0.25 and rec["d_head"] == 8
    assert calls[-1] == (2 * 2 * 40, 2 * 2 * 40) and len(calls) == 160


def test_both_attentions_learn_a_small_lookup():
    """With fewer keys than feature dimensions linear attention can keep them apart too."""
    for kind in ("softmax", "linear"):
        s = train_lookup(LookupConfig(n_keys=16, n_values=8, n_pairs=4, d_model=32, batch=32, steps=300,
                                      n_eval=500, seed=1, attention=kind))["summary"]
        assert s["accuracy"] >= 0.9, (kind, s)


def test_bad_settings_are_shape_errors():
    with pytest.raises(qkv.ShapeError, match="attention must be one of"):
        train_lookup(LookupConfig(attention="sparse"))
    with pytest.raises(qkv.ShapeError, match="n_pairs must be <= n_keys"):
        recall_experiment(RecallConfig(pairs=(4, 300), n_keys=256))


def test_the_command_writes_json_and_png(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("rich")
    monkeypatch.setattr(recall.RecallConfig, "quick", classmethod(lambda cls: cls(**dict(TINY, steps=10))))
    assert main(["experiment", "recall", "--quick", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "recall.json").read_text())
    assert rec["pairs"] == [2, 4] and len(rec["softmax"]) == len(rec["linear"]) == 2
    assert (tmp_path / "recall.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 4 |" in capsys.readouterr().out
