"""The checkpoint loader never crashes or lies: every corruption of a copy of the real
all-MiniLM-L6-v2 folder is a CheckpointError naming the file and the field, or loads and
gives the same embeddings as the intact folder."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="needs the models extra (safetensors)")
pytest.importorskip("tokenizers", reason="needs the models extra (tokenizers)")

import qkv  # noqa: E402
from qkv.extras import MissingExtra  # noqa: E402
from qkv.models import CheckpointError, default_model_path, load_bert  # noqa: E402

TEXTS = ["The animal didn't cross the street because it was too tired.", "Short.", ""]


@pytest.fixture(scope="module")
def intact():
    try:
        folder = default_model_path()
    except MissingExtra as err:
        pytest.skip(f"the corruptions start from the offline all-MiniLM-L6-v2: {err}")
    return folder, load_bert(folder).encode(TEXTS)


def copy_with(tmp_path, source, name: str, content):
    """A copy of ``source`` (links to its files) in which the file ``name`` holds ``content``:
    JSON text for a str name's value, or what ``content(original dict)`` returns."""
    for f in source.rglob("*"):
        if f.is_file():
            dest = tmp_path / f.relative_to(source)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if f.relative_to(source).as_posix() == name:
                if callable(content):
                    content = content(json.loads(f.read_text()))
                dest.write_text(content if isinstance(content, str) else json.dumps(content))
            else:
                dest.symlink_to(f)
    return tmp_path


def edit(**fields):
    """The original JSON object with ``fields`` replaced."""
    return lambda original: {**original, **fields}


REFUSED = [  # (file, content, the message must name the file and the field)
    ("config.json", [], r"config\.json must hold a JSON object .*got a list"),
    ("config.json", None, r"config\.json must hold a JSON object .*got null"),
    ("config.json", "{not json", r"cannot read .*config\.json"),
    ("config.json", edit(layer_norm_eps="abc"), r"config\.json: layer_norm_eps must be a number.*'abc'"),
    ("config.json", edit(layer_norm_eps=None), r"config\.json: layer_norm_eps must be a number.*None"),
    ("config.json", edit(layer_norm_eps=[1e-12]), r"config\.json: layer_norm_eps must be a number.*\[1e-12\]"),
    ("config.json", edit(layer_norm_eps=-1e-12), r"config\.json: layer_norm_eps must be a number.*-1e-12"),
    ("config.json", edit(layer_norm_eps=0), r"config\.json: layer_norm_eps"),
    ("config.json", edit(pad_token_id="x"), r"config\.json: pad_token_id must be an int >= 0; got 'x'"),
    ("config.json", edit(pad_token_id=30522),
     r"config\.json: pad_token_id must be a token id in \[0, vocab_size\) = \[0, 30522\); got 30522"),
    ("config.json", edit(pad_token_id=-1), r"config\.json: pad_token_id must be an int >= 0; got -1"),
    ("config.json", edit(model_type=["bert"]), r"config\.json: model_type must be one of"),
    ("config.json", edit(hidden_act=None), r"config\.json: hidden_act must be one of"),
    ("config.json", edit(vocab_size="30522"), r"config\.json: vocab_size must be a positive int"),
    ("config.json", edit(hidden_size=True), r"config\.json: hidden_size must be a positive int"),
    ("config.json", edit(vocab_size=1000), r"model\.safetensors: tensor embeddings\.word_embeddings\.weight"),
    ("modules.json", ["Transformer", "Pooling"], r"modules\.json: entry \[0\] must be an object"),
    ("modules.json", {"a": 1}, r"modules\.json must hold a JSON list .*got an object"),
    ("modules.json", [{"type": 3}], r"modules\.json: entry \[0\] must be an object with a string 'type'"),
    ("modules.json", [{"type": "sentence_transformers.models.Pooling", "path": 1}], r"modules\.json: entry \[0\]"),
    ("sentence_bert_config.json", [], r"sentence_bert_config\.json must hold a JSON object .*got a list"),
    ("sentence_bert_config.json", edit(max_seq_length=0), r"sentence_bert_config\.json: max_seq_length .* got 0"),
    ("sentence_bert_config.json", edit(max_seq_length="256"), r"sentence_bert_config\.json: max_seq_length"),
    ("sentence_bert_config.json", edit(max_seq_length=100000),
     r"sentence_bert_config\.json: max_seq_length must be at most 512"),
    ("sentence_bert_config.json", edit(do_lower_case="no"), r"sentence_bert_config\.json: do_lower_case"),
    ("1_Pooling/config.json", [True], r"1_Pooling/config\.json must hold a JSON object"),
    ("tokenizer.json", "{}", r"cannot read .*tokenizer\.json"),
]


@pytest.mark.parametrize("name, content, match", REFUSED, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(REFUSED)])
def test_corruption_is_a_checkpoint_error_naming_file_and_field(tmp_path, intact, name, content, match):
    folder = copy_with(tmp_path, intact[0], name, content)
    with pytest.raises(CheckpointError, match=match):
        load_bert(folder)


ACCEPTED = [  # values that mean what the intact file says: same embeddings
    ("config.json", edit(pad_token_id=None)),                 # null: BERT's 0
    ("config.json", lambda c: {k: v for k, v in c.items() if k != "layer_norm_eps"}),  # BERT's 1e-12
    ("sentence_bert_config.json", edit(max_seq_length=None)),  # null: the position embeddings
    ("config.json", edit(layer_norm_eps=1e-12)),               # int or float: the same number
]


@pytest.mark.parametrize("name, content", ACCEPTED)
def test_harmless_variants_load_and_give_the_same_embeddings(tmp_path, intact, name, content):
    folder, expected = intact
    model = load_bert(copy_with(tmp_path, folder, name, content))
    np.testing.assert_array_equal(model.encode(TEXTS), expected)


@pytest.mark.parametrize("tensor, value, at", [
    ("embeddings.word_embeddings.weight", math.nan, (1037, 5)),
    ("encoder.layer.3.output.dense.bias", math.inf, (7,)),
    ("encoder.layer.5.attention.self.query.weight", -math.inf, (0, 383)),
])
def test_non_finite_weights_are_refused(tmp_path, intact, tensor, value, at):
    from safetensors.numpy import load_file, save_file

    folder = intact[0]
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[tensor][at] = value
    copy = copy_with(tmp_path, folder, "model.safetensors", None)  # replaced below
    (copy / "model.safetensors").unlink()
    save_file(tensors, str(copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor {re.escape(tensor)} holds 1 non-finite"):
        load_bert(copy)


def test_a_float64_weight_beyond_float32_is_refused(tmp_path, intact):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(intact[0] / "model.safetensors"))
    big = tensors["embeddings.LayerNorm.bias"].astype(np.float64)
    big[3] = 1e300  # finite in the file, inf once read as float32
    tensors["embeddings.LayerNorm.bias"] = big
    copy = copy_with(tmp_path, intact[0], "model.safetensors", None)
    (copy / "model.safetensors").unlink()
    save_file(tensors, str(copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"embeddings\.LayerNorm\.bias holds 1 non-finite value"):
        load_bert(copy)


@pytest.mark.parametrize("texts, match", [
    (None, "texts must be a string or a list of strings; got NoneType"),
    (3, "texts must be a string or a list of strings; got int"),
    ([b"bytes"], r"texts\[0\] is bytes"),
])
def test_encode_bad_texts_is_a_shape_error(intact, texts, match):
    model = load_bert(intact[0])
    with pytest.raises(qkv.ShapeError, match=match):
        model.encode(texts)
