"""qkv train lookup: a short seeded run must learn; the command writes its files."""
import json

import numpy as np
import pytest

import qkv
from qkv.cli import main
from qkv.experiments.lookup import LookupConfig, lookup_batch, train_lookup

SMALL = dict(n_keys=16, n_values=8, n_pairs=6, d_model=16, batch=32, steps=250, n_eval=500)


def test_the_task_is_well_formed():
    data = lookup_batch(np.random.default_rng(0), 50, 6, 16, 8)
    for row in range(50):
        assert len(set(data["keys"][row])) == 6  # distinct keys: the answer is unique
        slot = data["slot"][row]
        assert data["keys"][row, slot] == data["query"][row]
        assert data["values"][row, slot] == data["target"][row]


def test_a_short_run_learns_the_lookup_and_attends_to_the_key():
    result = train_lookup(LookupConfig(seed=1, **SMALL))
    s = result["summary"]
    assert s["accuracy"] >= 0.95, s
    assert s["attention_on_key"] >= 0.8, s
    assert result["losses"][-20:].mean() < 0.2 * result["losses"][:5].mean()


def test_the_seed_makes_the_run_reproducible():
    cfg = dict(SMALL, steps=20)
    a, b = train_lookup(LookupConfig(seed=3, **cfg)), train_lookup(LookupConfig(seed=3, **cfg))
    np.testing.assert_array_equal(a["losses"], b["losses"])
    c = train_lookup(LookupConfig(seed=4, **cfg))
    assert not np.array_equal(a["losses"], c["losses"])


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_model_gradients_match_finite_differences(attention):
    """The whole lookup model (embeddings, attention, readout, loss) in float64, every
    parameter sampled: its backward is the derivative of its loss, for both attentions."""
    from qkv.nn import cross_entropy
    from qkv.experiments.lookup import LookupModel

    cfg = LookupConfig(n_keys=6, n_values=5, n_pairs=3, d_model=4, n_heads=2, attention=attention)
    model = LookupModel(cfg, np.random.default_rng(0))
    for layer in model.layers:
        for k in layer.params:
            layer.params[k] = layer.params[k].astype(np.float64)
            layer.grads[k] = np.zeros_like(layer.params[k])
        layer.dtype = np.dtype(np.float64)
    data = lookup_batch(np.random.default_rng(1), 4, 3, 6, 5)
    _, d = cross_entropy(model.forward(data), data["target"])
    model.backward(d)
    eps = 1e-6
    for layer in model.layers:
        for name, p in layer.params.items():
            g = layer.grads[name].copy()
            flat = p.reshape(-1)
            for i in range(0, flat.size, max(1, flat.size // 5)):
                old = flat[i]
                flat[i] = old + eps
                up = cross_entropy(model.forward(data), data["target"])[0]
                flat[i] = old - eps
                down = cross_entropy(model.forward(data), data["target"])[0]
                flat[i] = old
                assert (up - down) / (2 * eps) == pytest.approx(g.reshape(-1)[i], abs=1e-7), (type(layer).__name__, name)


def test_bad_settings_are_shape_errors():
    with pytest.raises(qkv.ShapeError, match="n_pairs must be <= n_keys"):
        train_lookup(LookupConfig(n_keys=4, n_pairs=5))
    assert main(["train", "lookup", "--heads", "3", "--no-progress"]) == 2


def test_the_command_writes_summary_and_pictures(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("rich")
    out = tmp_path / "run"
    args = ["train", "lookup", "--steps", "150", "--keys", "16", "--values", "8", "--pairs", "4",
            "--d-model", "16", "--batch", "32", "--seed", "2", "--out", str(out)]
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert {"accuracy", "steps", "seconds"} <= set(summary) and summary["steps"] == 150
    assert summary["accuracy"] > 0.5
    for name in ("loss.png", "attention.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "held-out accuracy" in capsys.readouterr().out


def test_out_that_is_a_file_fails_before_training(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["train", "lookup", "--no-progress", "--out", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert "--out must be a folder" in err and "Traceback" not in err


def test_zero_steps_with_out_still_writes_its_files(tmp_path):
    pytest.importorskip("matplotlib")
    args = ["train", "lookup", "--steps", "0", "--keys", "8", "--values", "4", "--pairs", "3",
            "--d-model", "8", "--no-progress", "--out", str(tmp_path)]
    assert main(args) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 0
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
