"""A nanoGPT user's habits on ``qkv train gpt`` (issue 54): config files, ``--name=value``
overrides, ``always_save_checkpoint=False`` (``--keep-best``), ``eval_only`` (``--eval-only``).

The config file below is nanoGPT's ``config/train_shakespeare_char.py`` as published (its
values shrunk to a test's size, its comments kept)."""
import json
import pickle

import numpy as np
import pytest

from qkv.errors import ShapeError
from qkv.io.nanoconfig import map_settings, read_config_file, read_override

pytest.importorskip("safetensors", reason="qkv train gpt writes safetensors: pip install -e '.[models]'")

from qkv.cli import main  # noqa: E402

SHAKESPEARE_CHAR = """# train a miniature character-level shakespeare model
# good for debugging and playing on macbooks and such

out_dir = 'out-shakespeare-char'
eval_interval = 3 # keep frequent because we'll overfit
eval_iters = 2
log_interval = 1 # don't print too too often

# we expect to overfit on this small dataset, so only save when val improves
always_save_checkpoint = False

wandb_log = False # override via command line if you like
wandb_project = 'shakespeare-char'
wandb_run_name = 'mini-gpt'

dataset = 'shakespeare_char'
gradient_accumulation_steps = 1
batch_size = 4
block_size = 16 # context of up to 256 previous characters

# baby GPT model :)
n_layer = 1
n_head = 2
n_embd = 16
dropout = 0.2

learning_rate = 1e-3 # with baby networks can afford to go a bit higher
max_iters = 5000
lr_decay_iters = 5000 # make equal to max_iters usually
min_lr = 1e-4 # learning_rate / 10 usually
beta2 = 0.99 # make a bit bigger because number of tokens per iter is small

warmup_iters = 2 # not super necessary potentially

# on macbook also add
# device = 'cpu'  # run on cpu only
# compile = False # do not torch compile the model
"""


def _data(root):
    """nanoGPT's data/shakespeare_char/ as its prepare.py writes it, from a small text."""
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 60
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    folder = root / "data" / "shakespeare_char"
    folder.mkdir(parents=True)
    n = int(len(text) * 0.9)
    np.array([stoi[c] for c in text[:n]], dtype=np.uint16).tofile(folder / "train.bin")
    np.array([stoi[c] for c in text[n:]], dtype=np.uint16).tofile(folder / "val.bin")
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": len(chars), "itos": dict(enumerate(chars)),
                                                    "stoi": stoi}))


def test_config_file_is_read_as_data_and_mapped(tmp_path):
    path = tmp_path / "train_shakespeare_char.py"
    path.write_text(SHAKESPEARE_CHAR + "gradient_accumulation_steps = 5 * 8\n")
    items = read_config_file(path)
    fields, command, notes = map_settings(items + [read_override("--max_iters=600"), read_override("--bias=True")])
    assert fields["steps"] == 600 and fields["lr"] == 1e-3 and fields["grad_accum"] == 40 and fields["bias"] is True
    assert fields["keep_best"] is True and fields["warmup"] == 2 and fields["lr_decay_steps"] == 5000
    assert command == {"out": "out-shakespeare-char", "log_interval": 1, "data": "data/shakespeare_char"}
    assert any("wandb_log" in n for n in notes)
    assert read_override("--init_from=resume")[1] == "resume"    # not a literal: the string, as nanoGPT


@pytest.mark.parametrize("line, said", [
    ("import time\n", "line 2: 'import time'"),
    ("wandb_run_name = 'ft-' + str(time.time())\n", "line 2"),
    ("n_layer = int('4')\n", "runs nothing"),
])
def test_config_file_refuses_code_naming_the_line(tmp_path, line, said):
    path = tmp_path / "finetune.py"
    path.write_text("batch_size = 1\n" + line)
    with pytest.raises(ShapeError, match=said):
        read_config_file(path)


def test_settings_without_an_equivalent_or_of_another_type_are_named():
    with pytest.raises(ShapeError, match="'max_iter' has no equivalent"):
        map_settings([read_override("--max_iter=600")])
    with pytest.raises(ShapeError, match="--max_iters=abc: nanoGPT's max_iters must be an int; got str"):
        map_settings([read_override("--max_iters=abc")])


@pytest.mark.slow
def test_a_nanogpt_config_file_trains_keeps_the_best_and_evaluates(tmp_path, monkeypatch, capsys):
    """qkv train gpt config/train_shakespeare_char.py --max_iters=6: nanoGPT's folder, out_dir and
    settings; always_save_checkpoint=False keeps the best evaluation; eval_only evaluates it."""
    monkeypatch.chdir(tmp_path)
    _data(tmp_path)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "train_shakespeare_char.py").write_text(SHAKESPEARE_CHAR)
    assert main(["train", "gpt", "config/train_shakespeare_char.py", "--max_iters=6", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "wandb_log = False is ignored" in out
    run = tmp_path / "out-shakespeare-char"
    cfg = json.loads((run / "config.json").read_text())["extra"]["train"]["config"]
    assert (cfg["steps"], cfg["batch_size"], cfg["n_embd"], cfg["dropout"], cfg["keep_best"]) == (6, 4, 16, 0.2, True)
    assert cfg["activation"] == "gelu" and cfg["decay_embeddings"] is True        # nanoGPT's model and AdamW
    log = json.loads((run / "log.json").read_text())
    vals = {e["step"]: e["val_loss"] for e in log["evals"]}
    best = min((s for s in vals if s > 0), key=vals.get)
    assert len(log["losses"]) == best                                  # the checkpoint is the best evaluation's
    assert out.count(f"val loss {vals[6]:.4f}") == 1                   # the last evaluation printed once
    assert main(["train", "gpt", "config/train_shakespeare_char.py", "--init_from=resume", "--eval_only=True",
                 "--max_iters=6", "--no-progress"]) == 0
    assert f"step {best}: train loss" in capsys.readouterr().out
    assert json.loads((run / "log.json").read_text()) == log           # eval_only writes nothing
    assert main(["train", "gpt", "config/train_shakespeare_char.py", "--steps", "7", "--max_iters=6"]) == 2
    assert "--steps 7 disagrees with the nanoGPT setting 6 (--max_iters=6: max_iters)" in capsys.readouterr().err
