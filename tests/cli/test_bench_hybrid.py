"""`qkv bench --suite hybrid` and `--suite hybrid-decode`: quick runs end to end, every row has
its keys, and the cache bytes follow what each layer keeps: a full attention layer's KV cache
grows with the context, a windowed one's (Griffin's) stops at its window, the recurrent layers'
states do not grow (bytes, not time, so they can be asserted)."""
import json

import pytest

from qkv import cli
from qkv.models.hybrid import parse_mixer, resolve

LM_KEYS = {"part": str, "pattern": str, "n_layer": int, "kinds": list, "params": int, "steps": int,
           "ms_per_step": float, "tokens_per_s": float, "val_loss": float, "train_loss": float,
           "curve": list, "data": str, "config": dict}
DECODE_KEYS = {"part": str, "pattern": str, "size": str, "n_layer": int, "n_embd": int, "n_head": int,
               "context": int, "kinds": list, "ms_per_token": float, "tokens_per_s": float, "cache_bytes": int,
               "attention_bytes": int, "state_bytes": int}


@pytest.fixture
def tiny(monkeypatch):
    from qkv_benchmarks import hybrid_suite
    monkeypatch.setitem(hybrid_suite.STEPS, "quick", 2)
    monkeypatch.setitem(hybrid_suite.CONTEXTS, "quick", (16, 80, 100))  # griffin's window: 64
    monkeypatch.setitem(hybrid_suite.SIZES, "quick", (("cpu", 16, 2),))
    return hybrid_suite


def _run(tmp_path, *suites) -> tuple[dict, str]:
    out = tmp_path / "h.json"
    args = ["bench", "--quick", "--threads", "1", "--json", str(out)]
    for s in suites:
        args += ["--suite", s]
    assert cli.main(args) == 0
    return json.loads(out.read_text()), out


def _typed(row: dict, keys: dict) -> None:
    for key, kind in keys.items():
        assert isinstance(row[key], kind), (key, row[key])


def test_hybrid_trains_every_pattern(tiny, tmp_path, capsys):
    data, _ = _run(tmp_path, "hybrid")
    text = capsys.readouterr().out
    rows = data["hybrid"]
    assert data["skipped"] == {} and data["main"] == [] and data["hybrid_decode"] == []
    assert [(r["pattern"], r["n_layer"]) for r in rows] == [(n, k) for n, _, k in tiny.PATTERNS]
    for r, (_, layers, n_layer) in zip(rows, tiny.PATTERNS):
        _typed(r, LM_KEYS)
        assert r["part"] == "lm" and r["steps"] == 2
        assert r["kinds"] == list(resolve(layers, n_layer))
        assert "attention" in {k.partition(":")[0] for k in r["kinds"]}  # n_layer holds the attention layer
        assert r["ms_per_step"] > 0 and r["val_loss"] > 0 and r["params"] > 0
    assert len({r["params"] for r in rows}) == len(rows)  # different models, not one trained four times
    assert "layer patterns: nanoGPT's CPU recipe" in text
    shown = [line.split()[0] for line in text.splitlines() if line.split()[:1] in (["attention"], ["jamba"])]
    assert shown == ["attention", "attention", "jamba"]


def test_hybrid_decode_cache_bytes_grow_for_full_attention_only(tiny, tmp_path, capsys):
    data, path = _run(tmp_path, "hybrid-decode")
    text = capsys.readouterr().out
    rows = data["hybrid_decode"]
    assert len(rows) == tiny.decode_count(quick=True) == len(tiny.PATTERNS) * 3
    for r in rows:
        _typed(r, DECODE_KEYS)
        assert r["part"] == "decode" and r["ms_per_token"] > 0 and r["tokens_per_s"] > 0
        assert r["cache_bytes"] == r["attention_bytes"] + r["state_bytes"]
        # a KV cache: keys and values, every head, float32, of L + 1 tokens (a window of W: min(W, L + 1))
        windows = [parse_mixer(k)[1].get("window") for k in r["kinds"] if k.startswith("attention")]
        tokens = [r["context"] + 1 if w is None else min(w, r["context"] + 1) for w in windows]
        assert r["attention_bytes"] == sum(2 * r["n_embd"] * n * 4 for n in tokens)
    for name, _, n_layer in tiny.PATTERNS:
        mine = [r for r in rows if (r["pattern"], r["n_layer"]) == (name, n_layer)]
        assert [r["context"] for r in mine] == [16, 80, 100]
        assert len({r["state_bytes"] for r in mine}) == 1  # the states: the same at every context
        assert (mine[0]["state_bytes"] > 0) == (name != "attention")
        kv = [r["attention_bytes"] for r in mine]
        if name == "griffin":  # one local attention layer of window 64 in 4 blocks: flat past 64
            assert kv[0] < kv[1] == kv[2] == 2 * 16 * 64 * 4
        else:
            assert kv[0] < kv[1] < kv[2]
    assert "decoding one token, batch 1" in text and "L=100" in text


def test_the_docs_render_the_records(tiny, tmp_path):
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("tables", Path(__file__).parents[2] / "docs" / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    data, _ = _run(tmp_path, "hybrid", "hybrid-decode")
    md = tables.render({"command": "qkv bench --suite hybrid", "recorded": "now", **data})
    assert md.count("| attention |") == 4 and md.count("| jamba |") == 2  # its rows in each table
    for table in md.split("\n\n"):
        lines = [line for line in table.splitlines() if line.startswith("|")]
        assert len({line.count("|") for line in lines}) <= 1, table  # no cell holds a column's bar


def test_the_filled_cache_is_what_the_step_reads(tiny):
    """The synthetic fill: every KV cache holds L tokens, every state L tokens seen, and a step
    through it goes to L + 1 (the real step, not a stand-in)."""
    import numpy as np
    model = tiny.decode_model("griffin", 3, 16, 2, 64)
    cache = tiny.filled_cache(model, 50, np.random.default_rng(0))
    assert cache.length == 50 and all(getattr(e, "length") == 50 for e in cache)
    model.eval()
    logits = model.forward(np.array([[3]]), cache=cache)
    assert logits.shape == (1, 1, tiny.DECODE_VOCAB) and np.isfinite(logits).all()
    assert cache.length == 51
    tiny.set_length(cache, 50)
    assert cache.length == 50 and all(e.length == 50 for e in cache)
