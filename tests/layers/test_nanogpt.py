"""What a nanoGPT user does with ``qkv train gpt`` and ``qkv sample`` (issue 38), on tiny models.

nanoGPT's ``.bin`` data against the same text (float64, equal), a meta.pkl that would run
code (refused, not run), gradient accumulation against the N-times batch (float64 to 1e-10),
``--init-from`` a GPT-2 that transformers saved (the first loss is transformers' loss on the
same batch), a BPE tokenizer trained here, the recipe's flags, what a resume past the
schedule's horizon says, nanoGPT's sampling options and its per-step log lines.
"""
import json
import os
import pickle

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="qkv train gpt writes safetensors: pip install -e '.[models]'")

from qkv.cli import main  # noqa: E402
from qkv.io.checkpoint import CheckpointError  # noqa: E402
from helpers import text_corpus  # noqa: E402

TINY = ["--block-size", "16", "--batch-size", "4", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
        "--eval-iters", "2", "--warmup", "2", "--no-progress"]
F64 = [*TINY, "--lr", "1e-2", "--dtype", "float64"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "play.txt"
    path.write_text(text_corpus(120))
    return path


def char_bin_folder(text: str, folder, *, meta=True):
    """nanoGPT's shakespeare_char/prepare.py: sorted characters, the first 90 % / the rest, uint16."""
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    n = int(len(text) * 0.9)
    folder.mkdir(parents=True, exist_ok=True)
    np.array([stoi[c] for c in text[:n]], dtype=np.uint16).tofile(folder / "train.bin")
    np.array([stoi[c] for c in text[n:]], dtype=np.uint16).tofile(folder / "val.bin")
    if meta:
        with open(folder / "meta.pkl", "wb") as f:
            pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    return folder


def _log(folder):
    return json.loads((folder / "log.json").read_text())


def _weights(folder):
    from qkv.models import load_gpt

    return load_gpt(folder)[0].params


# --- 1. data -----------------------------------------------------------------------------------

def test_bin_folder_trains_as_the_same_text(text_file, tmp_path, capsys):
    """float64: nanoGPT's train.bin/val.bin/meta.pkl of a text give the losses and weights of the text itself."""
    from qkv.training.bindata import bin_dataset

    folder = char_bin_folder(text_file.read_text(), tmp_path / "data")
    ds = bin_dataset(folder)
    assert isinstance(ds.train, np.memmap) and ds.train.dtype == np.uint16 and ds.tokenizer.vocab_size < 60
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", "gpt", "--data", str(text_file), "--out", str(a), "--steps", "4", *F64]) == 0
    assert main(["train", "gpt", "--data", str(folder), "--out", str(b), "--steps", "4", *F64]) == 0
    assert "val tokens from" in capsys.readouterr().out
    assert _log(a)["losses"] == _log(b)["losses"]
    wa, wb = _weights(a), _weights(b)
    for name in wa:
        np.testing.assert_allclose(wb[name], wa[name], rtol=0, atol=1e-10, err_msg=name)
    assert main(["train", "gpt", "--out", str(b), "--resume", "--steps", "5", "--no-progress"]) == 0
    assert main(["sample", str(b), "--prompt", "KING", "--tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("resuming")
    (folder / "val.bin").write_bytes((folder / "val.bin").read_bytes()[:-2])
    assert main(["train", "gpt", "--out", str(b), "--resume", "--steps", "6", "--no-progress"]) == 2
    assert "is not the one the run" in capsys.readouterr().err


def test_text_ids_are_held_in_two_bytes():
    from qkv.training.chardata import CharDataset

    ds = CharDataset(text_corpus(20))
    x, y = ds.batch("train", 2, 8, np.random.default_rng(0))
    assert ds.ids.dtype == np.uint16 and x.dtype == y.dtype == np.int64


class _Runs:
    def __reduce__(self):
        return (os.system, ("touch ran-code",))


def test_a_meta_pkl_that_names_code_is_refused_unrun(tmp_path, monkeypatch):
    from qkv.training.bindata import bin_dataset, read_meta

    monkeypatch.chdir(tmp_path)
    folder = char_bin_folder("abcdefgh" * 20, tmp_path / "d")
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 8, "itos": _Runs()}))
    with pytest.raises(CheckpointError, match="asks for posix.system.*runs no code"):
        bin_dataset(folder)
    assert not (tmp_path / "ran-code").exists()
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 3, "itos": {0: "a", 1: "bc"}}))
    with pytest.raises(CheckpointError, match="itos must map the ids 0..2"):
        read_meta(folder / "meta.pkl")
    (folder / "train.bin").unlink()
    with pytest.raises(CheckpointError, match="train.bin missing"):
        bin_dataset(folder)


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory):
    """A byte-level BPE of 300 tokens trained here on the test text, saved as tokenizer.json."""
    tk = pytest.importorskip("tokenizers", reason="BPE needs tokenizers: pip install -e '.[models]'")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=300, initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text_corpus(120)], trainer)
    folder = tmp_path_factory.mktemp("bpe")
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_a_text_encoded_with_bpe_trains_resumes_and_samples(text_file, bpe_folder, tmp_path, capsys):
    from qkv.training.bpe import load_bpe

    tok = load_bpe(bpe_folder)
    text = text_file.read_text()
    assert tok.decode(tok.encode(text)) == text and 256 <= tok.vocab_size <= 300
    out = tmp_path / "run"
    assert main(["train", "gpt", "--data", str(text_file), "--tokenizer", str(bpe_folder), "--out", str(out),
                 "--steps", "2", *TINY]) == 0
    meta = json.loads((out / "config.json").read_text())
    assert meta["extra"]["tokenizer"]["kind"] == "bpe" and meta["config"]["vocab_size"] == tok.vocab_size
    n = int(len(text) * 0.9)
    assert _log(out)["evals"] and (out / "tokenizer.json").is_file()
    assert main(["train", "gpt", "--out", str(out), "--resume", "--steps", "3", "--no-progress"]) == 0
    assert main(["sample", str(out), "--prompt", text[n:n + 20], "--tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.split("\n")[-2].startswith(text[n:n + 20].split("\n")[-1])


def test_gpt2_tokenizer_offline_says_how_to_get_it(text_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-home"))
    assert main(["train", "gpt", "--data", str(text_file), "--tokenizer", "gpt2", "--out", str(tmp_path / "r"),
                 *TINY]) == 2
    err = capsys.readouterr().err
    assert "GPT-2's tokenizer files are not here" in err and "snapshot_download('gpt2'" in err
    assert "--tokenizer PATH" in err and not (tmp_path / "r").exists()


@pytest.mark.parametrize("flags, said", [
    (["--log-interval", "0"], "--log-interval must be an int >= 1; got 0"),
    (["--gradient-accumulation-steps", "0"], "--gradient-accumulation-steps must be an int >= 1; got 0"),
    (["--grad-clip", "-1"], "--grad-clip must be a finite number in [0, inf); got -1.0"),
    (["--beta2", "1"], "--beta2 must be a finite number in [0, 1); got 1.0"),
])
def test_bad_new_flags_are_refused_by_name(text_file, tmp_path, capsys, flags, said):
    out = tmp_path / "never"
    assert main(["train", "gpt", "--data", str(text_file), "--out", str(out), *TINY, *flags]) == 2
    assert said in capsys.readouterr().err and not out.exists()


def test_tokenizer_char_is_refused_where_the_ids_are_not_characters(text_file, tmp_path, capsys):
    folder = char_bin_folder("abcdefgh" * 40, tmp_path / "d")
    assert main(["train", "gpt", "--data", str(folder), "--tokenizer", "char", "--out", str(tmp_path / "r"),
                 *TINY]) == 2
    assert "holds token ids already" in capsys.readouterr().err


# --- 2. fine-tuning ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    torch = pytest.importorskip("torch", reason="the GPT-2 comparison needs PyTorch: pip install -e '.[torch]'")
    transformers = pytest.importorskip("transformers", reason="the GPT-2 comparison needs pip install -e '.[hf]'")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=24, n_embd=32, n_layer=2, n_head=4,
                                  bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    folder = tmp_path_factory.mktemp("gpt2")
    hf.save_pretrained(folder)
    return folder, hf


def test_init_from_a_saved_gpt2_starts_at_transformers_loss(gpt2_folder, tmp_path, capsys):
    """float64: the first step's loss is transformers' loss on the same batch (the run's first
    batch, drawn again from the data Generator); --block-size 16 crops the 24 positions."""
    import torch

    from qkv.training.bindata import bin_dataset
    from qkv.training.loop import data_rng

    folder, hf = gpt2_folder
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(1)
    rng.integers(0, 50, 3000).astype(np.uint16).tofile(data / "train.bin")
    rng.integers(0, 50, 400).astype(np.uint16).tofile(data / "val.bin")
    out = tmp_path / "run"
    args = ["train", "gpt", "--init-from", str(folder), "--data", str(data), "--out", str(out), "--steps", "2",
            "--block-size", "16", "--batch-size", "3", "--eval-iters", "1", "--dtype", "float64", "--lr", "1e-4",
            "--no-progress"]
    assert main(args) == 0
    assert f"from {folder}" in capsys.readouterr().out
    x, y = bin_dataset(data).batch("train", 3, 16, data_rng(0))
    with torch.no_grad():
        want = hf.double()(torch.from_numpy(x), labels=torch.from_numpy(x)).logits
        want = torch.nn.functional.cross_entropy(want.reshape(-1, 50), torch.from_numpy(y).reshape(-1)).item()
    hf.float()
    assert abs(_log(out)["losses"][0] - want) < 1e-10
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["config"]["block_size"] == 16 and cfg["config"]["bias"] is True and cfg["config"]["n_layer"] == 2
    np.testing.assert_allclose(_weights(out)["transformer.wpe.weight"].shape, (16, 32))
    assert main(["sample", str(out), "--tokens", "2"]) == 2
    assert "no tokenizer" in capsys.readouterr().err
    assert main(["train", "gpt", "--out", str(out), "--resume", "--steps", "3", "--no-progress"]) == 0
    assert len(_log(out)["losses"]) == 3
    assert main(args[:2] + ["--init-from", str(folder), "--data", str(data), "--out", str(tmp_path / "x"),
                            "--n-layer", "3", "--no-progress"]) == 2
    assert "decides the model's shape: --n-layer 3 (the checkpoint has 2)" in capsys.readouterr().err
    assert main(args[:2] + ["--init-from", str(folder), "--data", str(data), "--out", str(tmp_path / "y"),
                            "--block-size", "32", "--no-progress"]) == 2
    assert "more than the 24 positions" in capsys.readouterr().err


def test_init_from_gpt2_absent_offline_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    pytest.importorskip("huggingface_hub", reason="hub ids need pip install -e '.[models]'")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert main(["train", "gpt", "--init-from", "gpt2", "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--init-from gpt2" in err and "snapshot_download('gpt2'" in err and "save_pretrained" in err


# --- 3. the recipe's knobs ---------------------------------------------------------------------

def test_gradient_accumulation_equals_the_bigger_batch(text_file, tmp_path):
    """float64: 3 micro-batches of 2 rows per update against batches of 6 rows: the same losses
    and weights to 1e-10 (the micro-batches are the big batch's rows, drawn in the same order)."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["train", "gpt", "--data", str(text_file), "--steps", "3", "--eval-interval", "3", *F64]
    assert main([*common, "--out", str(a), "--batch-size", "6"]) == 0
    assert main([*common, "--out", str(b), "--batch-size", "2", "--gradient-accumulation-steps", "3"]) == 0
    np.testing.assert_allclose(_log(b)["losses"], _log(a)["losses"], rtol=0, atol=1e-10)
    wa, wb = _weights(a), _weights(b)
    for name in wa:
        np.testing.assert_allclose(wb[name], wa[name], rtol=0, atol=1e-10, err_msg=name)


def test_recipe_flags_reach_the_model_and_the_optimizer(text_file, tmp_path, capsys):
    from qkv.io.runfiles import load_run

    out = tmp_path / "run"
    assert main(["train", "gpt", "--data", str(text_file), "--out", str(out), "--steps", "1", *TINY,
                 "--weight-decay", "0.05", "--beta1", "0.8", "--beta2", "0.95", "--grad-clip", "0", "--bias",
                 "--activation", "gelu", "--decay-embeddings"]) == 0
    run = load_run(out)
    c = run.cfg
    assert (c.weight_decay, c.beta1, c.beta2, c.grad_clip, c.bias, c.activation, c.decay_embeddings) == \
        (0.05, 0.8, 0.95, 0.0, True, "gelu", True)
    assert run.model.config.activation == "gelu" and run.model.config.bias
    assert run.opt.clip is None and (run.opt.b1, run.opt.b2, run.opt.weight_decay) == (0.8, 0.95, 0.05)
    decayed = {run.opt.keys[i] for i, slot in enumerate(run.opt.slots) if slot[4]}
    assert "transformer.wte.weight" in decayed and "transformer.wpe.weight" in decayed
    assert not any(k.endswith(("bias", "ln_1.weight")) for k in decayed)
    assert main(["train", "gpt", "--out", str(out), "--resume", "--steps", "2", "--no-bias"]) == 2
    assert "--bias False (the run has True)" in capsys.readouterr().err


def test_exact_gelu_is_not_the_tanh_one():
    from qkv.models import GPT, GPTConfig

    kw = dict(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8, dtype=np.float64, seed=1)
    idx = np.arange(8)[None] % 11
    exact, approx = GPT(GPTConfig(activation="gelu", **kw)), GPT(GPTConfig(**kw))
    for p in (*exact.params.values(), *approx.params.values()):
        p *= 20
    assert np.abs(exact.forward(idx) - approx.forward(idx)).max() > 1e-6


# --- 4, 5, 6: resume past the horizon, sampling, log lines ---------------------------------------

def test_resume_past_the_horizon_says_what_the_schedule_does(text_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "gpt", "--data", str(text_file), "--out", str(out), "--steps", "3", *TINY]) == 0
    printed = capsys.readouterr().out
    assert "step 0: train loss" in printed and "step 1: loss " in printed and " ms, " in printed and "tok/s" in printed
    assert main(["train", "gpt", "--out", str(out), "--resume", "--steps", "5", "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "reaches min_lr 0.0001 at step 3" in said and "steps 4-5 train at min_lr" in said
    assert "--lr-decay-steps 5" in said
    assert main(["train", "gpt", "--out", str(out), "--resume", "--steps", "7", "--lr-decay-steps", "7",
                 "--no-progress", "--log-interval", "2"]) == 0
    said = capsys.readouterr().out
    assert "the cosine reaches min_lr 0.0001 at step 7; step 6 trains at lr" in said
    assert "step 6: loss" in said and "step 7: loss" not in said


def test_sample_as_nanogpt(text_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "gpt", "--data", str(text_file), "--out", str(out), "--steps", "2", *TINY]) == 0
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("KING:\nThe")
    capsys.readouterr()
    assert main(["sample", str(out), "--prompt", f"FILE:{prompt}", "--tokens", "6", "--num-samples", "3"]) == 0
    samples = capsys.readouterr().out.split("---------------\n")
    assert len(samples) == 4 and samples[-1] == "" and all(s.startswith("KING:\nThe") for s in samples[:3])
    greedy = []
    for seed in ("0", "5"):
        assert main(["sample", str(out), "--prompt", "KING", "--tokens", "8", "--temperature", "0", "--seed", seed]) == 0
        greedy.append(capsys.readouterr().out)
    assert greedy[0] == greedy[1] and greedy[0].startswith("KING")
    assert main(["sample", str(out), "--prompt", f"FILE:{tmp_path / 'none.txt'}"]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_a_run_saved_before_these_fields_still_resumes(text_file, tmp_path):
    """Back-compat: a config.json without the new training fields, data kind or vocab_size (a run of
    before they existed, whose MLP was the tanh GELU, the default then)."""
    out = tmp_path / "run"
    assert main(["train", "gpt", "--data", str(text_file), "--out", str(out), "--steps", "2", *TINY,
                 "--activation", "gelu_tanh"]) == 0
    meta = json.loads((out / "config.json").read_text())
    for key in ("activation", "decay_embeddings", "grad_accum", "init_from", "vocab_size"):
        del meta["extra"]["train"]["config"][key]
    del meta["extra"]["train"]["data"]["kind"]
    (out / "config.json").write_text(json.dumps(meta))
    assert main(["train", "gpt", "--out", str(out), "--resume", "--steps", "3", "--no-progress"]) == 0
    assert len(_log(out)["losses"]) == 3
