"""Every bad run setting or data file is named before the run starts (issue 51, section 3): sizes the
machine cannot hold, token ids outside the vocabulary, a meta.pkl that is not nanoGPT's, data of
the wrong kind on --resume, an empty --out; and a recurrent layer's divergence takes attention's
path (the step, what went non-finite, a lower lr, exit 1)."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from qkv.errors import ShapeError

pytest.importorskip("safetensors", reason="qkv train gpt writes safetensors: pip install -e '.[models]'")

from qkv.cli import main  # noqa: E402
from qkv.io.checkpoint import CheckpointError  # noqa: E402
from helpers import text_corpus  # noqa: E402

TINY = ["--block-size", "16", "--batch-size", "4", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
        "--eval-iters", "2", "--warmup", "2", "--no-progress"]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "play.txt"
    path.write_text(text_corpus(400))
    return path


def _bin_folder(folder, text, *, extra_id=None, meta=None):
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
    if extra_id is not None:
        ids[len(ids) // 3] = extra_id
    folder.mkdir(parents=True, exist_ok=True)
    n = int(len(ids) * 0.9)
    ids[:n].tofile(folder / "train.bin")
    ids[n:].tofile(folder / "val.bin")
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": {}} if meta is None else meta
    (folder / "meta.pkl").write_bytes(pickle.dumps(meta))
    return folder


# --- sizes the machine cannot hold ---------------------------------------------------------------

def test_the_estimate_refuses_what_exceeds_the_memory_and_names_the_flag_and_figure():
    from qkv.training.memory import check_fits, training_bytes
    from qkv.training.config import TrainConfig

    cfg = TrainConfig().resolved()
    parts = training_bytes(cfg, 65)
    need = sum(parts.values())
    check_fits(cfg, 65, available=need)  # exactly enough: accepted
    with pytest.raises(ShapeError, match=r"^--batch-size 12, --block-size 64: the run needs at least 0\.0 GB"):
        check_fits(cfg, 65, {"batch_size": "--batch-size", "block_size": "--block-size"}, available=need - 1)
    wide = TrainConfig(n_embd=100_000, n_head=4).resolved()
    with pytest.raises(ShapeError, match=r"^n_embd 100000, n_layer 4: the run needs at least 5,1\d\d\.\d GB .*"
                                         r"more than the 1\.0 GB available"):
        check_fits(wide, 65, available=10**9)
    # a lower bound: the default run's parts are what it surely holds (weights x4, logits and their gradient)
    assert parts["weights"] >= 4 * 4 * 65 * 128 and parts["activations"] >= 4 * 12 * 64 * 2 * 65


@pytest.mark.parametrize("flag, value", [("--batch-size", "100000000"), ("--n-embd", "100000")])
def test_train_refuses_sizes_that_cannot_fit_before_allocating(corpus_file, tmp_path, capsys, flag, value):
    """Before: --batch-size 100000000 was killed by the OOM killer at 14 GB; --n-embd 100000 a raw MemoryError."""
    out = tmp_path / "run"
    assert main(["train", "gpt", "--data", str(corpus_file), "--out", str(out), *TINY, "--n-head", "4",
                 flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {value}" in err and "GB of memory" in err and "available on this machine" in err
    assert not out.exists()


def test_mqar_refuses_widths_that_cannot_fit(capsys, tmp_path):
    assert main(["experiment", "mqar", "--quick", "--widths", "100000", "--no-progress",
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "widths 100000: the run needs at least" in err and "n_layer" not in err


def test_mqar_refuses_a_mixer_or_width_named_twice():
    from qkv.experiments.mqar import MQARConfig

    with pytest.raises(ShapeError, match="mixers must name each value once.*attention more than once"):
        MQARConfig(mixers=("attention", "attention")).check()
    with pytest.raises(ShapeError, match="widths must name each value once.*64"):
        MQARConfig(widths=(64, 64)).check()


# --- data files ------------------------------------------------------------------------------

def test_token_ids_outside_the_vocabulary_are_found_up_front_naming_the_file(tmp_path, capsys):
    text = text_corpus(120)
    folder = _bin_folder(tmp_path / "data", text, extra_id=len(set(text)) + 3)
    assert main(["train", "gpt", "--data", str(folder), "--out", str(tmp_path / "run"), *TINY, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{folder / 'train.bin'} holds the token id {len(set(text)) + 3} at position" in err
    assert "meta.pkl's vocabulary" in err and not (tmp_path / "run").exists()


def test_check_ids_reads_the_file_in_chunks_and_names_the_first_bad_id():
    from qkv.training.bindata import check_ids

    ids = np.zeros(1000, np.uint16)
    ids[777], ids[900] = 50, 60
    check_ids(ids, "t.bin", 61, "v", chunk=64)
    with pytest.raises(CheckpointError, match="t.bin holds the token id 50 at position 777, outside v of 50"):
        check_ids(ids, "t.bin", 50, "v", chunk=64)


@pytest.mark.parametrize("meta, said", [
    ({"vocab_size": 10**12, "itos": {0: "a"}}, "itos must map the ids 0..999999999999 (vocab_size = 1,000,000,000,000) to single characters; it maps 1 ids"),
    ({"vocab_size": "65", "itos": {0: "a"}}, "vocab_size must be an int >= 1 (the number of characters); got str '65'"),
    ({"vocab_size": 2.0, "itos": {0: "a", 1: "b"}}, "vocab_size must be an int >= 1"),
    ({"vocab_size": 2, "itos": {0: "a", "x": "b"}}, "itos must map the ids 0..1"),
])
def test_a_meta_pkl_that_is_not_nanogpts_is_named(tmp_path, meta, said):
    """Before: vocab_size 10**12 was a raw MemoryError, a non-integer one a generic message, and
    mixed keys a raw TypeError."""
    from qkv.training.bindata import read_meta

    (tmp_path / "meta.pkl").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match="meta.pkl") as info:
        read_meta(tmp_path / "meta.pkl")
    assert said in str(info.value)


def test_resume_with_data_of_the_other_kind_says_what_the_run_was_trained_on(corpus_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "gpt", "--data", str(corpus_file), "--out", str(out), *TINY, "--steps", "1"]) == 0
    folder = _bin_folder(tmp_path / "data", text_corpus(120))
    capsys.readouterr()
    assert main(["train", "gpt", "--out", str(out), "--resume", "--data", str(folder), "--steps", "2",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"is a folder, but the run in {out} was trained on the text file {corpus_file}" in err
    assert "is neither" not in err


def test_an_empty_out_is_refused(corpus_file, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "gpt", "--data", str(corpus_file), "--out", "", *TINY, "--steps", "1"]) == 2
    assert "--out must name a folder; got ''" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# --- a recurrent layer's divergence --------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("mixer", ["mamba2", "gated_delta", "rglru"])
def test_a_recurrent_layer_diverging_takes_the_divergence_path(corpus_file, tmp_path, capsys, mixer):
    """Before: its layer's argument check ("log_decay must be finite and <= 0 ... got nan"), exit 2."""
    out = tmp_path / "run"
    assert main(["train", "gpt", "--data", str(corpus_file), "--out", str(out), *TINY, "--layers", mixer,
                 "--lr", "1e30", "--grad-clip", "0", "--warmup", "0", "--steps", "4", "--eval-interval", "1"]) == 1
    err = capsys.readouterr().err
    assert "the run diverged at step 1" in err and "lower --lr" in err and "must be finite" in err


def test_a_refusal_at_the_first_forward_stays_the_settings_error():
    """The same ShapeError before any update (the settings, not the weights) is not called divergence."""
    from qkv.training.chardata import CharDataset
    from qkv.training.loop import TrainConfig, new_run, train_step

    ds = CharDataset(text_corpus(50))
    run = new_run(TrainConfig(block_size=8, batch_size=2, n_layer=1, n_head=2, n_embd=8), ds, "x", text_corpus(50))
    with pytest.raises(ShapeError) as info:
        train_step(run, np.zeros((2, 9), np.int64), np.zeros((2, 9), np.int64))  # longer than block_size
    assert "diverged" not in str(info.value) and "block_size" in str(info.value)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_mqar_divergence_is_named_with_its_model_and_exits_1(tmp_path, capsys):
    """Before: a raw Diverged traceback (attention), the recurrence's argument check (mamba2)."""
    assert main(["experiment", "mqar", "--mixers", "attention", "mamba2", "--widths", "32", "--steps", "4",
                 "--pairs", "4", "--seq-len", "32", "--lrs", "1e30", "--seeds", "0", "--no-progress",
                 "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "the model attention at width 32 diverged at every lr (1e+30): the run diverged at step" in err
    assert "lower --lrs" in err
    assert "Traceback" not in err and not (tmp_path / "o" / "mqar.json").exists()


def test_diverged_crosses_processes_with_its_model():
    from qkv.training.loop import Diverged, TrainConfig

    err = Diverged(3, "the batch loss is nan", TrainConfig())
    err.model = "mamba2 at width 8"
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and back.step == 3 and back.model == "mamba2 at width 8"
