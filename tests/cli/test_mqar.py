"""qkv experiment mqar: Zoology's multi-query associative recall, its data, its accuracy, its runs."""
import json

import numpy as np
import pytest

import qkv
from qkv.cli import main
from qkv.experiments import mqar
from qkv.experiments.mqar import MQARConfig, layers, mixture, mqar_experiment, train_one
from qkv.experiments.mqar_data import mqar_batch, query_accuracy
from qkv.models import GPT, GPTConfig

TINY = dict(mixers=("attention", "attention+linear"), widths=(8,), pairs=(2, 4), seq_len=16, vocab_size=32,
            steps=3, batch=4, warmup=1, n_eval=4)


@pytest.mark.parametrize("pairs,queries", [(4, None), (8, 3), (16, 16), (1, 1)])
def test_every_answer_is_the_value_of_its_key(pairs, queries):
    d = mqar_batch(np.random.default_rng(1), 32, pairs, 64, 64, queries=queries)
    x, y, keys, values = d["inputs"], d["targets"], d["keys"], d["values"]
    q = pairs if queries is None else queries
    assert x.shape == y.shape == (32, 64) and x.dtype == y.dtype == np.int64
    assert keys.shape == values.shape == (32, pairs) and d["query_pos"].shape == (32, q)
    assert ((keys >= 1) & (keys < 32)).all() and ((values >= 32) & (values < 64)).all()
    assert ((x >= 0) & (x < 64)).all()
    for b in range(32):
        assert len(set(keys[b])) == pairs and len(set(values[b])) == pairs
        assert (x[b, 0:2 * pairs:2] == keys[b]).all() and (x[b, 1:2 * pairs:2] == values[b]).all()
        table = dict(zip(keys[b], values[b]))
        asked = np.flatnonzero(y[b] != -1)
        assert len(asked) == q and (asked >= 2 * pairs).all() and ((asked - 2 * pairs) % 2 == 0).all()
        assert sorted(asked) == sorted(d["query_pos"][b])
        assert len(set(x[b, asked])) == q                             # each query a different key
        for t in asked:
            assert x[b, t] in table and y[b, t] == table[x[b, t]]


def test_queries_lean_towards_the_pairs():
    """Zoology's power law: a query sits more often in the first half of the slots than the last."""
    pos = mqar_batch(np.random.default_rng(0), 400, 4, 256, 64)["query_pos"] - 8
    assert np.mean(pos < 124) > 0.6


def test_the_same_seed_gives_the_same_batch():
    a, b = (mqar_batch(np.random.default_rng(7), 8, 4, 32, 64) for _ in range(2))
    c = mqar_batch(np.random.default_rng(8), 8, 4, 32, 64)
    assert all((a[k] == b[k]).all() for k in a)
    assert not (a["inputs"] == c["inputs"]).all()
    x, y = mixture(np.random.default_rng(0), 7, (2, 4), 16, 32)
    assert x.shape == y.shape == (7, 16)
    assert [np.count_nonzero(r != -1) for r in y] == [2, 2, 2, 2, 4, 4, 4]


@pytest.mark.parametrize("kwargs,name", [
    (dict(pairs=9), "seq_len"), (dict(queries=5), "queries must be <= pairs"), (dict(vocab_size=8), "vocab_size"),
    (dict(pairs=0), "pairs"), (dict(batch=0), "batch"), (dict(queries=0), "queries"), (dict(seq_len=0), "seq_len")])
def test_impossible_settings_name_the_argument(kwargs, name):
    args = dict(batch=2, pairs=4, seq_len=32, vocab_size=64)
    args.update(kwargs)
    q = args.pop("queries", None)
    with pytest.raises(qkv.ShapeError, match=name):
        mqar_batch(np.random.default_rng(0), queries=q, **args)


def test_accuracy_counts_the_query_positions_only():
    d = mqar_batch(np.random.default_rng(3), 64, 8, 64, 128)
    y = d["targets"]
    right = np.eye(128)[np.where(y == -1, 0, y)]                      # copies the answer at the queries
    assert query_accuracy(right, y) == 1.0
    wrong_elsewhere = right.copy()
    wrong_elsewhere[y == -1] = np.eye(128)[5]                         # other positions do not count
    assert query_accuracy(wrong_elsewhere, y) == 1.0
    constant = np.broadcast_to(np.eye(128)[100], y.shape + (128,))
    assert query_accuracy(constant, y) < 0.05                         # chance: 1 / 64 values
    with pytest.raises(qkv.ShapeError, match="no query position"):
        query_accuracy(right, np.full_like(y, -1))


def test_gpt_loss_leaves_out_targets_of_minus_one():
    m = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=1, n_embd=8, dtype=np.float64))
    x = np.random.default_rng(0).integers(0, 16, (2, 8))
    y = np.full((2, 8), -1)
    y[0, 3], y[1, 5] = 4, 9
    whole = m.loss(x, np.where(y == -1, 0, y))
    part = m.loss(x, y)
    logits = m.forward(x)
    lse = np.log(np.exp(logits).sum(-1))
    assert part == pytest.approx(np.mean([lse[0, 3] - logits[0, 3, 4], lse[1, 5] - logits[1, 5, 9]]), rel=1e-12)
    assert part != whole
    with pytest.raises(qkv.ShapeError, match="not -1"):
        m.loss(x, np.full((2, 8), -1))


def test_mixer_names_make_two_layer_patterns():
    assert layers("mamba2") == "mamba2,mamba2" and layers("attention+rglru") == "attention,rglru"
    assert layers("attention", 3) == "attention:conv=3,attention:conv=3" and layers("linear", 3) == "linear,linear"
    assert layers("attention+mamba2", 4) == "attention:conv=4,mamba2"
    for bad in ("mamba2+attention", "attention+attention", "s4", "attention+linear+rglru"):
        with pytest.raises(qkv.ShapeError, match="mixers must be among"):
            layers(bad)


def test_the_experiment_returns_rows_for_every_mixer_width_and_pair_count():
    calls = []
    rec = mqar_experiment(MQARConfig(**TINY), progress=lambda *a: calls.append(a))
    json.dumps(rec)
    assert [(r["mixer"], r["width"], r["pairs"]) for r in rec["rows"]] == [
        ("attention", 8, 2), ("attention", 8, 4), ("attention+linear", 8, 2), ("attention+linear", 8, 4)]
    assert all(set(r) == {"mixer", "width", "pairs", "accuracy"} and 0 <= r["accuracy"] <= 1 for r in rec["rows"])
    assert calls[-1] == (6, 6) and len(calls) == 6
    assert rec["chance"] == 1 / 16 and len(rec["runs"]) == 2


def test_bad_configs_are_shape_errors():
    with pytest.raises(qkv.ShapeError, match="seq_len"):
        mqar_experiment(MQARConfig(**dict(TINY, pairs=(2, 5))))
    with pytest.raises(qkv.ShapeError, match="mixers must be among"):
        mqar_experiment(MQARConfig(**dict(TINY, mixers=("hyena",))))
    with pytest.raises(qkv.OptionError, match="widths"):
        MQARConfig(**dict(TINY, widths=(0,))).check()


def test_attention_learns_from_the_queries():
    """A few hundred steps on a small task: the loss at the queries falls well below guessing
    among the 16 values (ln 16 = 2.77) and the accuracy rises above chance (1 / 16)."""
    cfg = MQARConfig(mixers=("attention",), widths=(32,), pairs=(4,), seq_len=16, vocab_size=32, steps=150,
                     batch=32, warmup=10, lr=3e-3, n_eval=64, seed=0)
    r = train_one(cfg, "attention", 32)
    assert r["final_loss"] < 2.5 and r["accuracy"][0] > 2 / 16, r


def test_the_recipe_trains_as_zoology_on_its_mixture_of_lengths():
    cfg = MQARConfig()
    assert cfg.tasks() == [(4, 64), (8, 128), (16, 256), (32, 256), (64, 256)]
    assert [cfg.schedule(s)[0] for s in range(10)] == [4, 8, 4, 16, 4, 32, 4, 64, 4, 4]
    model = cfg.model_config("attention+mamba2", 64)
    assert model.positions == cfg.positions and model.dropout == 0
    assert cfg.attention_conv == 3 and model.layer_kinds == ("attention:conv=3", "mamba2")   # Zoology's BaseConv
    assert cfg.model_config("attention", 64).layer_kinds == ("attention:conv=3",) * 2
    assert cfg.train_config("attention", 64).layers == "attention:conv=3,attention:conv=3"
    plain = MQARConfig(attention_conv=0)
    assert plain.model_config("attention+mamba2", 64).layer_kinds == ("attention", "mamba2")
    assert plain.model_config("attention", 64).layers == ("attention", "attention")
    assert cfg.train_config("attention", 64).weight_decay == cfg.weight_decay
    quick = MQARConfig.quick()
    quick.check()
    assert quick.n_steps < cfg.n_steps and "attention" in quick.mixers
    with pytest.raises(qkv.OptionError, match="workers"):
        MQARConfig(**dict(TINY, workers=0)).check()
    with pytest.raises(qkv.OptionError, match="attention_conv must be an int >= 0"):
        MQARConfig(**dict(TINY, attention_conv=-1)).check()


def test_each_mixer_trains_its_own_steps_at_its_own_lr_unless_overridden():
    cfg = MQARConfig()
    assert cfg.steps is None and cfg.lr is None
    for m in cfg.mixers:
        steps, lr = mqar.RECIPE[m]
        tc = cfg.train_config(m, 64)
        assert (cfg.steps_of(m), cfg.lr_of(m)) == (tc.steps, tc.lr) == (steps, lr)
    assert set(mqar.RECIPE) == set(cfg.mixers)
    assert cfg.steps_of("attention") < min(cfg.steps_of(m) for m in mqar.RECURRENT + mqar.HYBRIDS)
    assert cfg.lr_of("gated_delta") > cfg.lr_of("attention")             # at 3e-3 it stays at chance
    assert cfg.n_steps == 3 * sum(mqar.RECIPE[m][0] for m in cfg.mixers)
    fixed = MQARConfig(steps=123, lr=1e-2)
    assert {(fixed.steps_of(m), fixed.train_config(m, 32).lr) for m in fixed.mixers} == {(123, 1e-2)}
    assert fixed.n_steps == 123 * 9 * 3
    with pytest.raises(qkv.ShapeError, match="mixers must be among"):
        cfg.steps_of("hyena")
    with pytest.raises(qkv.OptionError, match="steps"):
        MQARConfig(**dict(TINY, steps=0)).check()
    with pytest.raises(qkv.ShapeError, match="lr"):
        MQARConfig(**dict(TINY, lr=-1.0)).check()


def test_a_run_records_the_steps_and_lr_it_trained_with(monkeypatch):
    monkeypatch.setitem(mqar.RECIPE, "attention", (2, 5e-3))
    monkeypatch.setitem(mqar.RECIPE, "attention+linear", (4, 1e-3))
    calls = []
    rec = mqar_experiment(MQARConfig(**dict(TINY, steps=None)), progress=lambda *a: calls.append(a))
    assert [(r["mixer"], r["steps"], r["lr"]) for r in rec["runs"]] == [("attention", 2, 5e-3),
                                                                       ("attention+linear", 4, 1e-3)]
    assert calls[-1] == (6, 6) and rec["config"]["steps"] is None


def test_workers_give_the_bits_of_one_process():
    cfg = MQARConfig(**dict(TINY, mixers=("attention", "mamba2"), widths=(8, 16), steps=4))
    calls = []
    one = mqar_experiment(cfg)
    two = mqar_experiment(MQARConfig(**dict(TINY, mixers=("attention", "mamba2"), widths=(8, 16), steps=4,
                                             workers=2)), progress=lambda *a: calls.append(a))
    assert one["rows"] == two["rows"]
    assert [(r["mixer"], r["width"], r["final_loss"]) for r in one["runs"]] == \
        [(r["mixer"], r["width"], r["final_loss"]) for r in two["runs"]]
    assert calls[-1] == (16, 16) and len(calls) == 16


def test_the_command_writes_json_and_png(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("rich")
    monkeypatch.setattr(mqar.MQARConfig, "quick", classmethod(lambda cls: cls(**TINY)))
    assert main(["experiment", "mqar", "--quick", "--no-progress", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "mqar.json").read_text())
    assert len(rec["rows"]) == 4 and rec["rows"][-1]["mixer"] == "attention+linear"
    assert (tmp_path / "mqar.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| attention+linear | 8 |" in capsys.readouterr().out


def test_the_command_takes_mixers_widths_and_steps(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(mqar.MQARConfig, "quick", classmethod(lambda cls: cls(**TINY)))
    argv = ["experiment", "mqar", "--quick", "--no-progress", "--out", str(tmp_path), "--mixers", "attention+rglru",
            "--widths", "4", "--steps", "2", "--lr", "0.01"]
    assert main(argv) == 0
    rec = json.loads((tmp_path / "mqar.json").read_text())
    assert {(r["mixer"], r["width"]) for r in rec["rows"]} == {("attention+rglru", 4)} and rec["config"]["steps"] == 2
    assert rec["config"]["lr"] == rec["runs"][0]["lr"] == 0.01 and rec["runs"][0]["steps"] == 2
    assert rec["config"]["attention_conv"] == 3
    assert main(argv + ["--attention-conv", "0"]) == 0
    plain = json.loads((tmp_path / "mqar.json").read_text())
    assert plain["config"]["attention_conv"] == 0 and plain["runs"][0]["params"] < rec["runs"][0]["params"]
    assert main(["experiment", "mqar", "--no-progress", "--out", str(tmp_path), "--mixers", "hyena"]) == 2
    assert "mixers must be among" in capsys.readouterr().err


def test_a_model_that_met_the_stop_loss_stops_and_says_so():
    """A threshold every loss meets: each model stops after one cycle of the tasks (or the warm-up,
    whichever is longer); the record keeps the steps taken and the most it could take, and the
    progress still counts every step; 0 trains every step."""
    base = dict(TINY, steps=20, warmup=2)
    cfg = MQARConfig(**base, stop_loss=1e9)
    assert cfg.cycle() == 3                                   # pairs (2, 4): 2, 4, 2, then again
    calls = []
    rec = mqar_experiment(cfg, progress=lambda *a: calls.append(a))
    assert {(r["steps"], r["max_steps"]) for r in rec["runs"]} == {(3, 20)}
    assert calls[-1] == (40, 40) and len(calls) == 40
    late = mqar_experiment(MQARConfig(**dict(base, warmup=5), stop_loss=1e9))
    assert {r["steps"] for r in late["runs"]} == {5}
    full = mqar_experiment(MQARConfig(**base, stop_loss=0))
    assert {(r["steps"], r["max_steps"]) for r in full["runs"]} == {(20, 20)}
    assert MQARConfig().stop_loss == 0.03 and MQARConfig(stop_loss=None).cycle() == 9
    for bad in (-1.0, float("nan"), float("inf"), "0.1"):
        with pytest.raises(qkv.ShapeError, match="stop_loss must be a finite number >= 0"):
            MQARConfig(**base, stop_loss=bad).check()


def test_the_command_takes_a_stop_loss(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(mqar.MQARConfig, "quick", classmethod(lambda cls: cls(**dict(TINY, steps=12, warmup=1))))
    argv = ["experiment", "mqar", "--quick", "--no-progress", "--out", str(tmp_path), "--mixers", "attention"]
    assert main(argv + ["--stop-loss", "1e9"]) == 0
    rec = json.loads((tmp_path / "mqar.json").read_text())
    assert rec["config"]["stop_loss"] == 1e9 and rec["runs"][0]["steps"] == 3 and rec["runs"][0]["max_steps"] == 12
