"""Hybrid GPTs (issue 37 §1): ``GPTConfig(layers=...)`` with attention, Mamba-2, Gated DeltaNet,
RG-LRU and linear-attention blocks, the named patterns, training, gradients, files, cached
and ragged generation, ``qkv train gpt --layers`` and ``qkv sample``, MPI, and the refusals."""
from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest

from qkv import ShapeError
from qkv.models import GPT, GPTConfig, load_gpt
from qkv.models.gpt_cache import GPTCache
from qkv.nn import AdamW, ConvKVCache, KVCache, LinearState, RecurrentState

MIXERS = ["attention", "attention:window=3", "attention:chunk=4", "attention:conv=3", "attention:window=3:conv=2",
          "mamba2", "gated_delta", "rglru", "linear"]
PATTERNS = {"jamba": 5, "qwen3-next": 4, "griffin": 3}   # the fewest layers each takes


def tiny(layers, n_layer=2, **kw) -> GPTConfig:
    base = dict(vocab_size=13, block_size=16, n_layer=n_layer, n_head=2, n_embd=16, dtype=np.float64,
                layers=layers)
    return GPTConfig(**(base | kw))


def scaled(model: GPT, factor: float = 4.0) -> GPT:
    """Projections made larger, so that greedy choices are not near ties and the layers matter."""
    for name, p in model.params.items():
        if p.ndim >= 2 and "conv" not in name and "gate_weight" not in name:
            p *= factor
    return model


# --- patterns ------------------------------------------------------------------------------------
def test_patterns_scale_to_n_layer_and_save_with_the_config():
    assert tiny("jamba", 16).layer_kinds == tuple("attention" if i % 8 == 4 else "mamba2" for i in range(16))
    assert tiny("qwen3-next", 8).layer_kinds == ("gated_delta",) * 3 + ("attention",) + ("gated_delta",) * 3 + (
        "attention",)
    assert tiny("griffin", 5).layer_kinds == ("rglru", "rglru", "attention:window=64", "rglru", "rglru")
    assert tiny("mamba2,attention", 4).layer_kinds == ("mamba2", "attention") * 2     # a list repeats
    assert tiny(["rglru", " linear"]).layers == ("rglru", "linear")
    assert tiny(None).layer_kinds == ("attention", "attention")
    assert json.loads(json.dumps(tiny(["rglru", "linear"]).to_dict()))["layers"] == ["rglru", "linear"]
    model = GPT(tiny(["mamba2", "attention"]))
    assert {n.split(".")[3] for n in model.params if n.startswith("transformer.h.")} == {"ln_1", "ln_2", "mlp",
                                                                                           "mixer", "attn"}
    assert "transformer.h.0.mixer.A_log" in model.params and "transformer.h.1.attn.W_Q" in model.params


def test_all_attention_is_the_gpt_of_before_bit_for_bit():
    idx = np.random.default_rng(0).integers(0, 13, (2, 9))
    ref = GPT(tiny(None, dtype=np.float32))
    for layers in ("attention", ["attention", "attention"]):
        other = GPT(tiny(layers, dtype=np.float32))
        assert other.params.keys() == ref.params.keys()
        for name, p in ref.params.items():
            np.testing.assert_array_equal(other.params[name], p, err_msg=name)
        np.testing.assert_array_equal(other.forward(idx), ref.forward(idx))


@pytest.mark.parametrize("kw,match", [
    (dict(layers="jamba", n_layer=4), r"n_layer must be >= 5 for layers='jamba'"),
    (dict(layers="qwen3-next", n_layer=3), r"n_layer must be >= 4 for layers='qwen3-next'"),
    (dict(layers="griffin", n_layer=2), r"n_layer must be >= 3 for layers='griffin'"),
    (dict(layers="mamba2,attention,rglru", n_layer=4), r"layers has 3 entries, which must be n_layer = 4"),
    (dict(layers=["mamba3"]), r"each entry must be one of \['attention', 'mamba2'"),
    (dict(layers=["attention:window=0"]), r"attention:window=W, attention:chunk=N, attention:conv=K"),
    (dict(layers=["rglru:window=4"]), r"attention:window=W, attention:chunk=N, attention:conv=K"),
    (dict(layers=["attention:conv=0"]), r"\(W, N, K >= 1\), each at most once, joined by ':'"),
    (dict(layers=["attention:conv=3:conv=2"]), r"each at most once.*got 'attention:conv=3:conv=2'"),
    (dict(layers=["attention:conv"]), r"attention:conv=K"),
    (dict(layers=["mamba2:expand_v=2"]), r"mamba2's options are mamba2:expand=N"),
    (dict(layers=["based:feature=0"]), r"based's options are based:feature=N"),
    (dict(layers=[]), r"layers must be None, a pattern"),
    (dict(layers=7), r"layers must be None, a pattern"),
])
def test_patterns_that_cannot_be_made_name_the_argument(kw, match):
    with pytest.raises(ShapeError, match=match):
        tiny(**({"layers": None} | kw))


# --- training --------------------------------------------------------------------------------------
def _repeated_text_batch(cfg, b=4):
    ids = np.array([1, 2, 3, 4, 5, 6, 7, 1, 2, 8, 9, 10, 11, 12, 0, 3] * 4)
    starts = np.arange(b) * 3
    x = np.stack([ids[s:s + cfg.block_size] for s in starts])
    y = np.stack([ids[s + 1:s + cfg.block_size + 1] for s in starts])
    return x, y


@pytest.mark.parametrize("layers", MIXERS + list(PATTERNS))
def test_each_mixer_and_pattern_trains(layers):
    """float32 with dropout: 12 AdamW steps on one batch of a repeated text, the loss finite and falling."""
    n = PATTERNS.get(layers, 2)
    cfg = tiny(layers if layers in PATTERNS else [layers], n, dtype=np.float32, dropout=0.1, n_embd=16)
    model = GPT(cfg)
    opt = AdamW(model, lr=1e-2, clip=1.0)
    x, y = _repeated_text_batch(cfg)
    losses = []
    for _ in range(12):
        losses.append(model.loss(x, y))
        model.backward()
        assert all(np.isfinite(g).all() for g in model.grads.values())
        opt.step()
    assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.5, losses


def test_a_hybrid_gpts_gradient_matches_finite_differences():
    """float64: every kind of block in one model, a few entries of each block's parameters."""
    cfg = tiny(["mamba2", "gated_delta", "rglru", "linear", "attention:window=3", "attention:conv=3"], 6,
               block_size=8, bias=True, positions="rope")
    model = scaled(GPT(cfg), 2.0)
    x, y = np.random.default_rng(1).integers(0, 13, (2, 8)), np.random.default_rng(2).integers(0, 13, (2, 8))
    model.loss(x, y)
    model.backward()
    grads = {k: g.copy() for k, g in model.grads.items()}
    rng = np.random.default_rng(3)
    checked = 0
    for name, p in model.params.items():
        if not name.startswith("transformer.h.") or "ln_" in name:
            continue
        flat = p.reshape(-1)
        for i in rng.choice(flat.size, size=min(2, flat.size), replace=False):
            old = flat[i]
            flat[i] = old + 1e-6
            up = model.loss(x, y)
            flat[i] = old - 1e-6
            down = model.loss(x, y)
            flat[i] = old
            numeric = (up - down) / 2e-6
            assert abs(numeric - grads[name].reshape(-1)[i]) < 1e-7 + 1e-5 * abs(numeric), name
            checked += 1
    assert checked > 70


def test_save_load_and_resume_repeat_the_run_bit_for_bit(tmp_path):
    pytest.importorskip("safetensors", reason="GPT.save writes safetensors: pip install -e '.[models]'")
    from qkv.nn import cosine_lr

    cfg = tiny("qwen3-next", 4, dropout=0.1)
    x, y = _repeated_text_batch(cfg)

    def steps(model, opt, seeds):
        out = []
        for s in seeds:
            out.append(model.loss(np.roll(x, s, axis=0), np.roll(y, s, axis=0)))
            model.backward()
            opt.step(cosine_lr(s, lr=1e-2, warmup=2, max_steps=6, min_lr=1e-3))
        return out

    a = GPT(cfg)
    whole = steps(a, AdamW(a, clip=1.0), range(6))
    b = GPT(cfg)
    opt_b = AdamW(b, clip=1.0)
    first = steps(b, opt_b, range(3))
    b.save(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["config"]["layers"] == "qwen3-next"
    c, _ = load_gpt(tmp_path)
    c.rng.bit_generator.state = b.rng.bit_generator.state          # the dropout stream, as runfiles keeps it
    opt_c = AdamW(c, clip=1.0)
    opt_c.load_state_dict(opt_b.state_dict())
    assert c.config == b.config and c.config.layer_kinds[3] == "attention"
    assert first + steps(c, opt_c, range(3, 6)) == whole


def test_conv_attention_saves_its_convolution_under_the_blocks_attn(tmp_path):
    pytest.importorskip("safetensors", reason="GPT.save writes safetensors: pip install -e '.[models]'")
    from safetensors.numpy import load_file

    model = scaled(GPT(tiny(["attention:window=4:conv=3", "attention"], seed=8)))
    keys = [k for k in model.params if ".short_conv." in k]
    assert keys == [f"transformer.h.0.attn.short_conv.{n}" for n in ("W_proj", "b_proj", "conv_weight", "conv_bias")]
    assert model.params[keys[0]].std() > 0 and model.params[keys[2]].std() > 0.1    # taps keep their own init
    model.save(tmp_path)
    assert set(load_file(str(tmp_path / "model.safetensors"))) == set(model.params)
    again, _ = load_gpt(tmp_path)
    assert again.config.layers == ("attention:window=4:conv=3", "attention")
    idx = np.arange(10)[None] % 13
    np.testing.assert_array_equal(again.forward(idx), model.forward(idx))


def test_a_checkpoint_saved_before_layers_existed_loads_as_all_attention(tmp_path):
    pytest.importorskip("safetensors", reason="GPT.save writes safetensors: pip install -e '.[models]'")
    model = GPT(tiny(None))
    model.save(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    del meta["config"]["layers"]
    (tmp_path / "config.json").write_text(json.dumps(meta))
    again, _ = load_gpt(tmp_path)
    assert again.config.layers is None and again.config.layer_kinds == ("attention", "attention")
    idx = np.arange(8)[None] % 13
    np.testing.assert_array_equal(again.forward(idx), model.forward(idx))


# --- generation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers", MIXERS + list(PATTERNS))
def test_cached_generation_equals_uncached(layers):
    """Greedy, float64: the same tokens and logits to 1e-12, through the cache (KV for attention,
    states for the rest) and, past block_size, on the last block_size tokens."""
    n = PATTERNS.get(layers, 2)
    model = scaled(GPT(tiny(layers if layers in PATTERNS else [layers, "mamba2"], n, seed=3)))
    prompt = np.random.default_rng(2).integers(0, 13, (2, 5))
    ids, logits = model.generate(prompt, 14, temperature=0, return_logits=True)
    ids2, logits2 = model.generate(prompt, 14, temperature=0, use_cache=False, return_logits=True)
    np.testing.assert_array_equal(ids, ids2)
    np.testing.assert_allclose(logits, logits2, rtol=0, atol=1e-12)
    assert np.abs(logits[:, 1:] - logits[:, :-1]).max(axis=-1).min() > 1e-8   # every step has logits of its own
    cache = model.new_cache(2, 16)
    kinds = {type(e) for e in cache}
    assert isinstance(cache, GPTCache) and kinds <= {KVCache, ConvKVCache, RecurrentState, LinearState}
    assert len(cache) == n and (ConvKVCache in kinds) == ("conv=" in layers)


@pytest.mark.parametrize("layers", ["mamba2", "gated_delta", "rglru", "linear", "griffin", "attention:conv=3",
                                    ["attention:conv=3", "attention:conv=4"], ["mamba2", "attention:conv=3"]])
def test_ragged_batch_equals_each_alone(layers):
    """Right-padded prompts prefilled together (in one call when every block has a KV cache,
    ``attention:conv`` included; each alone when a block has a state) = each sequence alone."""
    n = 2 if isinstance(layers, list) else PATTERNS.get(layers, 2)
    if isinstance(layers, str):
        layers = layers if layers in PATTERNS else [layers, "attention"]
    model = scaled(GPT(tiny(layers, n, seed=4)))
    r = np.random.default_rng(5)
    prompts = [r.integers(0, 13, k) for k in (1, 6, 3)]
    together, logits = model.generate(prompts, 6, temperature=0, return_logits=True)
    for k, p in enumerate(prompts):
        alone, lg = model.generate(p[None], 6, temperature=0, return_logits=True)
        np.testing.assert_array_equal(together[k], alone[0])
        np.testing.assert_allclose(logits[k], lg[0], rtol=0, atol=1e-12)
    assert [len(s) for s in together] == [7, 12, 9]


def test_a_ragged_prefill_fills_each_row_and_the_cache_refuses_more_than_max_len():
    model = GPT(tiny(["rglru", "attention"], seed=6)).eval()
    idx = np.random.default_rng(7).integers(0, 13, (2, 4))
    cache = model.new_cache(2, 6)
    logits = model.forward(idx, cache=cache, q_lengths=np.array([4, 2]))
    assert cache.lengths.tolist() == [4, 2] and cache[1].lengths.tolist() == [4, 2] and cache[0].length == 4
    np.testing.assert_array_equal(logits[1, 2:], 0)                # the padding's rows
    np.testing.assert_allclose(logits[1, :2], model.forward(idx[1:, :2])[0], rtol=0, atol=1e-12)
    with pytest.raises(ShapeError, match=r"the cache is full: sequence 0 holds 4 of max_len = 6"):
        model.forward(idx[:, :3], cache=cache)
    with pytest.raises(ShapeError, match="cache must come from new_cache"):
        model.forward(idx, cache=list(cache))
    with pytest.raises(ShapeError, match="q_lengths= and kv_lengths= are not taken by a block around Mamba2"):
        GPT(tiny(["mamba2"])).h[0].forward(np.zeros((1, 2, 16)), q_lengths=np.array([1]))


# --- the command line and MPI --------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    from helpers import text_corpus

    path = tmp_path_factory.mktemp("corpus") / "play.txt"
    path.write_text(text_corpus(200))
    return path


TINY = ["--block-size", "12", "--batch-size", "4", "--n-head", "2", "--n-embd", "16", "--eval-iters", "2",
        "--eval-interval", "3", "--warmup", "2", "--lr", "1e-2", "--lr-decay-steps", "6", "--dtype", "float64",
        "--no-progress"]


def _cli(*args) -> tuple[int, str, str]:
    from qkv.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_train_gpt_layers_resumes_and_samples(corpus_file, tmp_path):
    """``--layers griffin``: 6 steps against 3 + ``--resume`` 3, the same losses and weights bit for
    bit; ``qkv sample`` continues the prompt; a resume cannot change ``--layers``."""
    pytest.importorskip("safetensors", reason="qkv train gpt writes safetensors: pip install -e '.[models]'")
    a, b = tmp_path / "a", tmp_path / "b"
    args = ["train", "gpt", "--data", str(corpus_file), "--layers", "griffin", "--n-layer", "3", *TINY]
    code, printed, err = _cli(*args, "--out", str(a), "--steps", "6")
    assert code == 0, err
    assert "3 layers (griffin)" in printed
    assert _cli(*args, "--out", str(b), "--steps", "3")[0] == 0
    code, printed, err = _cli("train", "gpt", "--out", str(b), "--resume", "--steps", "6", "--no-progress")
    assert code == 0 and "resuming at step 3 of 6" in printed, err
    la, lb = (json.loads((f / "log.json").read_text()) for f in (a, b))
    assert la["losses"] == lb["losses"] and len(la["losses"]) == 6
    assert [(e["train_loss"], e["val_loss"]) for e in la["evals"]] == [(e["train_loss"], e["val_loss"])
                                                                        for e in lb["evals"]]
    (ma, _), (mb, _) = load_gpt(a), load_gpt(b)
    assert ma.config.layers == "griffin" and ma.config.layer_kinds[2] == "attention:window=64"
    for name, p in ma.params.items():
        np.testing.assert_array_equal(p, mb.params[name], err_msg=name)
    code, out, err = _cli("sample", str(a), "--prompt", "KING:", "--tokens", "20", "--temperature", "0")
    assert code == 0 and out.startswith("KING:") and len(out) >= 25, err
    code, _, err = _cli("train", "gpt", "--out", str(b), "--resume", "--steps", "8", "--layers", "jamba")
    assert code == 2 and "--layers jamba (the run has griffin)" in err


@pytest.mark.parametrize("args,match", [
    (["--layers", "jamba", "--n-layer", "2"], "--n-layer must be >= 5 for --layers='jamba'"),
    (["--layers", "mamba2,s4"], "--layers: each entry must be one of"),
    (["--layers", "mamba2", "--init-from", "gpt2"], "--init-from gpt2 has softmax attention in every layer"),
])
def test_train_gpt_refuses_layers_it_cannot_make(corpus_file, tmp_path, args, match):
    pytest.importorskip("safetensors", reason="qkv train gpt writes safetensors: pip install -e '.[models]'")
    code, _, err = _cli("train", "gpt", "--data", str(corpus_file), "--out", str(tmp_path / "r"), *TINY, *args)
    assert code == 2 and match in err, err
    assert not (tmp_path / "r").exists()


def test_context_parallel_refuses_a_recurrent_layer():
    from qkv.distributed.train import check_context_layers

    check_context_layers(tiny(None))
    for layers, at in ((["attention", "rglru"], "'rglru' at layer 1"), (["attention:window=4"], "at layer 0")):
        with pytest.raises(ShapeError, match=f"parallel = 'context' needs plain softmax attention.*{at}"):
            check_context_layers(tiny(layers))


@pytest.mark.slow
def test_data_parallel_over_two_ranks_equals_one_process(corpus_file, tmp_path):
    """``mpiexec -n 2 qkv train gpt --layers gated_delta,attention`` (data parallel): the losses
    of one process (float64, 1e-10); ``--parallel context`` refuses the recurrent layer."""
    pytest.importorskip("safetensors", reason="qkv train gpt writes safetensors: pip install -e '.[models]'")
    from helpers import mpiexec

    args = ["train", "gpt", "--data", str(corpus_file), "--layers", "gated_delta,attention", "--n-layer", "2",
            *TINY, "--steps", "4"]
    assert _cli(*args, "--out", str(tmp_path / "one"))[0] == 0
    res = mpiexec(2, "-m", "qkv", *args, "--out", str(tmp_path / "two"), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    one, two = (json.loads((tmp_path / f / "log.json").read_text()) for f in ("one", "two"))
    assert len(two["losses"]) == 4 and np.max(np.abs(np.subtract(one["losses"], two["losses"]))) < 1e-10
    res = mpiexec(2, "-m", "qkv", *args, "--out", str(tmp_path / "ctx"), "--parallel", "context", timeout=120)
    assert res.returncode != 0 and "parallel = 'context' needs plain softmax attention" in res.stderr, res.stderr
