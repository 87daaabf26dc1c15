"""qkv experiment mqar: Zoology's multi-query associative recall, its data, its accuracy, its runs."""
import json

import numpy as np
import pytest

import qkv
from qkv.cli import main
from qkv.experiments import mqar
from qkv.experiments.mqar import MQARConfig, layers, train_one
from qkv.experiments.mqar_data import mqar_batch, query_accuracy
from qkv.experiments.mqar_runs import choose, mqar_experiment, run_all
from qkv.models import GPT, GPTConfig

TINY = dict(mixers=("attention", "attention+linear"), widths=(8,), pairs=(2, 4), seq_len=16, vocab_size=32,
            steps=3, batch=4, n_eval=4, n_val=4, val_every=2, lrs=(1e-3, 1e-2), seeds=(0, 1))


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


def zoology_multiquery_ar(rs, n, vocab, T, pairs, power_a=0.01, random_non_queries=True):
    """Zoology's ``multiquery_ar`` written out from its definition (numpy's sequential
    ``choice`` without replacement, the i-th gap drawn for the i-th pair); -1 for no label."""
    half, ctx = vocab // 2, 2 * pairs
    keys = np.stack([rs.choice(np.arange(1, half), pairs, replace=False) for _ in range(n)])
    values = np.stack([rs.choice(np.arange(half, vocab), pairs, replace=False) for _ in range(n)])
    space = (T - ctx) // 2
    p = power_a * np.arange(1, space + 1) ** (power_a - 1)
    p /= p.sum()
    gaps = np.stack([rs.choice(space, pairs, replace=False, p=p) for _ in range(n)])
    x = np.zeros((n, T + 1), dtype=np.int64)
    x[:, 0:ctx:2], x[:, 1:ctx:2] = keys, values
    np.put_along_axis(x[:, ctx:], gaps * 2, keys, axis=1)
    labels = np.full((n, T + 1), -1)
    np.put_along_axis(labels, gaps * 2 + ctx + 1, values, axis=1)
    x, labels = x[:, :-1], labels[:, 1:]
    if random_non_queries:
        noise = rs.randint(vocab, size=x.shape)
        x = np.where(x == 0, noise, x)
    return x, labels


def order_stats(x, y, pairs):
    """Per pair index i: the mean offset of its query; and the correlation of i with the offset."""
    rows, pos = np.nonzero(y != -1)
    first = x[:, 0:2 * pairs:2]
    idx = np.array([np.flatnonzero(first[r] == x[r, t])[0] for r, t in zip(rows, pos)])
    means = np.array([pos[idx == i].mean() for i in range(pairs)])
    return means, np.corrcoef(idx, pos)[0, 1]


@pytest.mark.parametrize("pairs,T", [(4, 64), (16, 128), (64, 256)])
def test_the_generator_matches_zoologys_order_and_ranges(pairs, T):
    """Query offsets per pair index and their correlation with the order, against Zoology's generator."""
    n = 1500
    ours = mqar_batch(np.random.default_rng(0), n, pairs, T, 8192)
    zx, zy = zoology_multiquery_ar(np.random.RandomState(0), n, 8192, T, pairs)
    m1, c1 = order_stats(ours["inputs"], ours["targets"], pairs)
    m2, c2 = order_stats(zx, zy, pairs)
    assert c1 > 0.05 and abs(c1 - c2) < 0.05                            # earlier pairs asked sooner, as Zoology
    assert np.abs(m1 - m2).max() < 0.1 * (T - 2 * pairs)
    for x, y in ((ours["inputs"], ours["targets"]), (zx, zy)):
        keys, vals = x[:, 0:2 * pairs:2], x[:, 1:2 * pairs:2]
        assert keys.min() >= 1 and keys.max() < 4096 and vals.min() >= 4096 and vals.max() < 8192
        assert ((y != -1).sum(1) == pairs).all() and (y[y != -1] >= 4096).all()
    noise = ours["inputs"][:, 2 * pairs:][ours["targets"][:, 2 * pairs:] == -1]
    assert abs(noise.mean() - 8191 / 2) < 0.05 * 8192                    # uniform over the whole vocabulary


def test_zero_filler_leaves_zeros_and_a_small_vocabulary_repeats_keys_as_noise():
    d = mqar_batch(np.random.default_rng(1), 64, 8, 128, 8192, filler="zero")
    rest, asked = d["inputs"][:, 16:], d["targets"][:, 16:] != -1
    assert (rest[~asked] == 0).all() and (rest[asked] > 0).all()

    def noisy(vocab):
        d = mqar_batch(np.random.default_rng(2), 400, 64, 256, vocab)
        x, y, hit = d["inputs"], d["targets"], 0
        for r, t in zip(*np.nonzero(y != -1)):
            hit += x[r, t] in x[r, 128:t]                                 # an earlier noise copy of its key
        return hit / np.count_nonzero(y != -1)
    assert noisy(8192) < 0.01 < 0.03 < noisy(288)
    with pytest.raises(qkv.ShapeError, match="filler"):
        mqar_batch(np.random.default_rng(0), 2, 4, 32, 64, filler="ones")


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


def test_mixer_names_make_zoologys_models():
    assert layers("mamba2") == "baseconv,mamba2:expand=2"
    assert layers("attention") == "baseconv,attention" and layers("attention", 0) == "attention"
    assert layers("attention+gated_delta") == "baseconv,attention,gated_delta:expand_v=2"
    assert layers("based", 4) == "baseconv:kernel=4,based"
    with pytest.raises(qkv.ShapeError, match="mixers must be among"):
        layers("mamba2+attention")


def test_every_model_has_the_same_budget_and_zoologys_recipe():
    cfg = MQARConfig(**TINY)
    for m in ("attention", "based", "attention+rglru"):
        tc = cfg.train_config(m, 8, 3e-3, 1).resolved()
        assert (tc.steps, tc.warmup, tc.min_lr, tc.weight_decay, tc.beta1, tc.beta2, tc.grad_clip) == \
            (3, 0, 0.0, 0.1, 0.9, 0.999, 0.0) and tc.decay_embeddings


def test_bad_configs_are_shape_errors():
    for kw, match in [(dict(mixers=("attention", "attention")), "once"), (dict(lrs=()), "lrs"),
                      (dict(lrs=(0.0,)), "lrs"), (dict(seeds=(-1,)), "seeds"), (dict(filler="x"), "filler"),
                      (dict(pairs=(9,)), "seq_len"), (dict(widths=(7,)), "n_head")]:
        with pytest.raises(qkv.ShapeError, match=match):
            MQARConfig(**{**TINY, **kw}).check()


def test_the_sweep_chooses_on_validation_never_on_the_test_set():
    run = lambda val, test, steps=10, div=False: {"val_accuracy": val, "accuracy": [test], "steps": steps,  # noqa: E731
                                                  "diverged": div}
    sweep = {("a", 8, 1e-3, 0): run(0.5, 0.9), ("a", 8, 1e-2, 0): run(0.6, 0.1),
             ("b", 8, 1e-3, 0): run(0.99, 0.5, 40), ("b", 8, 1e-2, 0): run(0.99, 0.4, 20),
             ("c", 8, 1e-3, 0): run(0.0, 0.0), ("c", 8, 1e-2, 0): run(0.9, 0.9, div=True)}
    assert choose(MQARConfig(**TINY), sweep) == {("a", 8): 1e-2, ("b", 8): 1e-2, ("c", 8): 1e-3}


def test_a_run_stops_at_validation_accuracy_and_scores_the_test_set(monkeypatch):
    from qkv.experiments import mqar as mod

    seen = []
    monkeypatch.setattr(mod, "accuracy", lambda model, batches: seen.append(len(batches)) or 1.0)
    r = train_one(MQARConfig(**{**TINY, "steps": 9}), "attention", 8, 1e-3, 0)
    assert r["steps"] == 2 and r["val_accuracy"] == 1.0                 # the first validation, step 2, stops it
    assert seen == [2, 1, 1]                                            # validation (2 tasks), then each pair count


def test_the_experiment_sweeps_then_trains_the_seeds_at_the_chosen_lr():
    rec = mqar_experiment(MQARConfig(**TINY))
    assert len(rec["runs"]) == 2 * (2 + 1)
    for m in TINY["mixers"]:
        runs = [r for r in rec["runs"] if r["mixer"] == m]
        assert [(r["lr"], r["seed"]) for r in runs[:2]] == [(1e-3, 0), (1e-2, 0)]
        assert runs[2]["seed"] == 1 and runs[2]["lr"] == rec["chosen_lr"][f"{m}@8"] and runs[2]["chosen"]
        assert sum(r["chosen"] for r in runs) == 2
    assert {"lr", "seed", "steps", "chosen"} <= set(rec["rows"][0]) and rec["machine"]
    assert len(rec["rows"]) == 6 * 2


@pytest.mark.slow
def test_workers_give_the_bits_of_one_process():
    cfg = MQARConfig(**TINY)
    runs = [(m, 8, lr, 0) for m in TINY["mixers"] for lr in TINY["lrs"]]
    one = run_all(cfg, runs)
    cfg.workers = 2
    assert run_all(cfg, runs).keys() == one.keys()
    two = run_all(cfg, runs)
    assert all(two[k]["accuracy"] == one[k]["accuracy"] and two[k]["final_loss"] == one[k]["final_loss"] for k in one)


@pytest.mark.slow
def test_mpi_ranks_give_the_rows_of_workers(tmp_path):
    """A real ``mpiexec -n 2``: the same command's record, its rows those of ``--workers 2``."""
    import os
    import shutil
    import subprocess
    import sys

    mpiexec = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        pytest.skip("no mpiexec")
    args = ["experiment", "mqar", "--no-progress", "--mixers", "attention", "attention+linear", "--widths", "8",
            "--pairs", "2", "4", "--seq-len", "16", "--vocab-size", "32", "--steps", "3", "--batch", "4",
            "--lrs", "1e-3", "1e-2", "--seeds", "0", "1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "qkv", *args, "--out", str(tmp_path / "mpi")],
                   check=True, env=env, timeout=300, capture_output=True)
    subprocess.run([sys.executable, "-m", "qkv", *args, "--workers", "2", "--out", str(tmp_path / "w")],
                   check=True, env=env, timeout=300, capture_output=True)
    a, b = (json.loads((tmp_path / d / "mqar.json").read_text()) for d in ("mpi", "w"))
    assert a["ranks"] == 2 and b["ranks"] == 1
    assert a["rows"] == b["rows"] and a["chosen_lr"] == b["chosen_lr"]


def test_the_command_writes_json_and_png(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["experiment", "mqar", "--no-progress", "--mixers", "attention", "--widths", "8", "--pairs", "2",
                 "--seq-len", "16", "--vocab-size", "32", "--steps", "2", "--batch", "4", "--lrs", "1e-3",
                 "--seeds", "0", "1", "--out", "o"]) == 0
    rec = json.loads((tmp_path / "o" / "mqar.json").read_text())
    assert (tmp_path / "o" / "mqar.png").stat().st_size > 0
    assert [r["seed"] for r in rec["runs"]] == [0, 1] and rec["config"]["vocab_size"] == 32
    out = capsys.readouterr().out
    assert "| attention | 8 | 0.001 |" in out and "(" in out.split("| attention | 8 |")[1]


def test_quick_is_attention_against_a_narrow_recurrence():
    cfg = MQARConfig.quick()
    cfg.check()
    assert cfg.mixers == ("attention", "mamba2") and cfg.vocab_size == 8192 and cfg.runs() == 2


def _record(table: dict, widths=(32, 64), pairs=(4, 8)) -> dict:
    """A record of the shape mqar_experiment writes: ``table[mixer] = {(width, pairs): [seed accs]}``."""
    rows = [{"mixer": m, "width": w, "pairs": p, "accuracy": a, "lr": 1e-3, "seed": s, "steps": 100,
             "val_accuracy": 0.5, "chosen": True}
            for m, cellz in table.items() for (w, p), accs in cellz.items() for s, a in enumerate(accs)]
    rows.append({**rows[0], "accuracy": 0.0, "lr": 1e-2, "chosen": False})   # a sweep run not chosen: not counted
    return {"rows": rows, "runs": [], "chosen_lr": {}, "config": {}}


def test_claims_say_what_held_and_where_it_failed_with_the_seeds():
    from qkv.experiments.mqar_report import claims

    grid = lambda f: {(w, p): f(w, p) for w in (32, 64) for p in (4, 8)}  # noqa: E731
    rec = _record({
        "attention": grid(lambda w, p: [0.99, 0.97, 0.90] if (w, p) == (32, 8) else [0.99, 0.99, 0.98]),
        "gated_delta": grid(lambda w, p: [0.1 * w / 32 / p * 4] * 3),                 # rises with width, falls with pairs
        "mamba2": grid(lambda w, p: {(32, 4): [0.3, 0.2, 0.25], (64, 4): [0.1, 0.1, 0.12]}.get((w, p), [0.01, 0.02, 0.0])),
        "linear": grid(lambda w, p: [0.0, 0.01, 0.02]),                               # at chance everywhere
        "attention+gated_delta": grid(lambda w, p: [0.05] * 3),
    })
    said = claims(rec)
    assert said[0] == ("attention >= 0.95 at every width and pair count, every seed: fails at width 32, 8 pairs "
                       "(seeds 0.990, 0.970, 0.900)")
    assert "gated_delta: rising with width, falling with pairs: holds" in said
    assert any(c.startswith("linear: rising with width, falling with pairs: at chance in every cell") for c in said)
    mamba = next(c for c in said if c.startswith("mamba2:"))
    assert mamba == ("mamba2: rising with width, falling with pairs: fails: 4 pairs, width 32 -> 64: 0.250 -> 0.100 "
                     "(seeds 0.300, 0.200, 0.250 -> 0.100, 0.100, 0.120)")      # 8 pairs: both at chance, not counted
    order = next(c for c in said if c.startswith("gated_delta >= mamba2 >= linear"))
    assert order.endswith("fails at width 32, 4 pairs: gated_delta 0.100, mamba2 0.250, linear 0.010")
    hybrid = next(c for c in said if c.startswith("attention+gated_delta >= gated_delta"))
    assert "fails at" in hybrid and "width 64, 4 pairs: 0.050 < 0.200" in hybrid


def test_an_interrupted_command_resumes_from_the_runs_it_kept(tmp_path, monkeypatch, capsys):
    """A run is never lost: each finished run is kept (mqar.runs.jsonl) as it ends; the same
    command after a kill trains only the missing runs, and its record has the rows an
    uninterrupted command writes. The kept file goes once mqar.json is written."""
    from qkv.experiments import mqar_runs

    monkeypatch.chdir(tmp_path)
    args = ["experiment", "mqar", "--no-progress", "--mixers", "attention", "linear", "--widths", "8",
            "--pairs", "2", "--seq-len", "16", "--vocab-size", "32", "--steps", "2", "--batch", "4",
            "--lrs", "1e-3", "1e-2", "--seeds", "0", "1"]
    assert main([*args, "--out", "whole"]) == 0
    whole = json.loads((tmp_path / "whole" / "mqar.json").read_text())
    assert not (tmp_path / "whole" / mqar_runs.KEPT).exists()
    real, trained = mqar_runs.train_one, []

    def killed_after_three(cfg, *run):
        if len(trained) == 3:
            raise KeyboardInterrupt
        trained.append(run)
        return real(cfg, *run)
    monkeypatch.setattr(mqar_runs, "train_one", killed_after_three)
    assert main([*args, "--out", "cut"]) != 0                          # Ctrl-C: the command says so and exits
    kept = (tmp_path / "cut" / mqar_runs.KEPT).read_text().splitlines()
    assert len(kept) == 3 and not (tmp_path / "cut" / "mqar.json").exists()
    (tmp_path / "cut" / mqar_runs.KEPT).write_text("\n".join(kept) + '\n{"key": "cut sh')   # a line the kill cut
    again = []
    monkeypatch.setattr(mqar_runs, "train_one", lambda cfg, *run: again.append(run) or real(cfg, *run))
    assert main([*args, "--out", "cut"]) == 0
    said = capsys.readouterr()
    assert "3 run(s) of this config kept" in said.out
    assert "1 line(s) of" in said.err and "skipped, their runs trained again: 1 not JSON" in said.err
    assert len(again) == len(whole["runs"]) - 3 and not set(again) & set(trained)
    resumed = json.loads((tmp_path / "cut" / "mqar.json").read_text())
    assert resumed["rows"] == whole["rows"] and resumed["chosen_lr"] == whole["chosen_lr"]
    assert not (tmp_path / "cut" / mqar_runs.KEPT).exists()
    other = mqar_runs.Kept(tmp_path / "cut" / "x.jsonl", MQARConfig(**TINY))
    other.add(("attention", 8, 1e-3, 0), {"accuracy": [1.0]})
    assert mqar_runs.Kept(other.path, MQARConfig(**{**TINY, "steps": 99})).done == {}   # another config's lines
