"""qkv.models.GPT: gradients, loss and AdamW steps against a plain PyTorch GPT of the same
architecture (qkv_benchmarks.torch_gpt), cached sampling against uncached, ragged batches,
saving and loading, and Hugging Face GPT-2 checkpoints (load_gpt2 against transformers)."""
import json

import numpy as np
import pytest

from qkv import ShapeError
from qkv.models import GPT, CheckpointError, GPTConfig, load_gpt, load_gpt2
from qkv.nn import AdamW, cosine_lr


def tiny(**kw) -> GPTConfig:
    base = dict(vocab_size=13, block_size=12, n_layer=2, n_head=2, n_embd=16, dtype=np.float64)
    return GPTConfig(**{**base, **kw})


def batch(cfg, b=3, t=None, seed=1):
    r = np.random.default_rng(seed)
    idx = r.integers(0, cfg.vocab_size, (b, t or cfg.block_size + 1))
    return idx[:, :-1], idx[:, 1:]


@pytest.fixture(scope="module")
def tg():
    """qkv_benchmarks.torch_gpt, with torch on one thread meanwhile: on a busy 2-core machine
    its thread pool turns a tiny model's step from 0.1 ms into tens of milliseconds."""
    torch = pytest.importorskip("torch", reason="the comparisons need PyTorch: pip install -e '.[torch]'")
    from qkv_benchmarks import torch_gpt

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch_gpt
    torch.set_num_threads(threads)


# --- against PyTorch ---------------------------------------------------------------------------
CONFIGS = {"gpt2": {}, "rope-gqa": dict(positions="rope", n_head=4, n_kv_head=2),
           "swiglu-nobias-untied": dict(activation="swiglu", bias=False, tie_weights=False),
           "gelu-exact": dict(activation="gelu", n_inner=24)}


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-4)])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_loss_and_every_gradient_match_torch(kind, dtype, tol, tg):
    import torch

    cfg = tiny(dtype=dtype, **CONFIGS[kind])
    model = GPT(cfg)
    ref = tg.load_qkv_weights(tg.make_torch_gpt(cfg), model)
    x, y = batch(cfg)
    loss = model.loss(x, y)
    model.backward()
    _, tloss = ref(torch.from_numpy(x), torch.from_numpy(y))
    tloss.backward()
    assert abs(loss - tloss.item()) <= tol * abs(tloss.item())
    theirs = tg.qkv_grads(ref, model)
    assert set(theirs) == set(model.grads)
    scale = max(np.abs(g).max() for g in theirs.values())
    for name, g in theirs.items():
        err = np.abs(model.grads[name] - g).max()
        if ".attn.b_K" in name:  # 0 by the math (a shift of every score of a row): rounding noise
            assert err <= tol * scale, name
        else:
            assert err <= tol * np.abs(g).max(), (name, err / np.abs(g).max())


def test_twenty_adamw_steps_match_torch(tg):
    import torch

    cfg = tiny()
    model = GPT(cfg)
    ref = tg.load_qkv_weights(tg.make_torch_gpt(cfg), model)
    opt = AdamW(model, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, clip=1.0)
    topt = tg.make_adamw(ref, 1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    decayed = {k for k, (*_, d) in zip(opt.keys, opt.slots) if d}
    assert "transformer.wte.weight" not in decayed and "transformer.h.0.attn.W_Q" in decayed
    assert sum(p.numel() for p in topt.param_groups[0]["params"]) == sum(model.params[k].size for k in decayed)
    for step in range(20):
        x, _ = batch(cfg, b=4, seed=step)
        y = (3 * x + 1) % cfg.vocab_size  # a rule to learn
        lr = cosine_lr(step, lr=1e-2, warmup=3, max_steps=20, min_lr=1e-3)
        loss = model.loss(x, y)
        model.backward()
        norm = opt.step(lr)
        topt.zero_grad()
        _, tloss = ref(torch.from_numpy(x), torch.from_numpy(y))
        tloss.backward()
        tnorm = tg.clip_and_step(ref, topt, 1.0, lr)
        assert loss == pytest.approx(tloss.item(), rel=1e-9, abs=0) and norm == pytest.approx(tnorm, rel=1e-9)
    assert loss < 2.0  # it learned: ln 13 = 2.56 at the start


def test_a_resumed_run_repeats_the_losses_bit_for_bit(tmp_path):
    pytest.importorskip("safetensors", reason="GPT.save writes safetensors: pip install -e '.[models]'")
    cfg = tiny(dropout=0.1)

    def steps(model, opt, seeds):
        out = []
        for s in seeds:
            out.append(model.loss(*batch(cfg, seed=s)))
            model.backward()
            opt.step(cosine_lr(s, lr=1e-2, warmup=2, max_steps=6, min_lr=1e-3))
        return out

    a = GPT(tiny())
    whole = steps(a, AdamW(a, clip=1.0), range(6))
    b = GPT(tiny())
    opt_b = AdamW(b, clip=1.0)
    first = steps(b, opt_b, range(3))
    b.save(tmp_path, extra={"vocab": "abc"})
    c, extra = load_gpt(tmp_path)
    opt_c = AdamW(c, clip=1.0)
    opt_c.load_state_dict(opt_b.state_dict())
    assert extra == {"vocab": "abc"} and c.config == b.config
    assert first + steps(c, opt_c, range(3, 6)) == whole


# --- sampling ------------------------------------------------------------------------------------
@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_cached_generation_equals_uncached(positions):
    """Greedy, float64: the same tokens and logits to 1e-12, including past block_size
    (where both run on the last block_size tokens)."""
    model = GPT(tiny(positions=positions, n_head=4, n_kv_head=2, seed=3))
    for p in model.params.values():  # weights large enough that the argmax is not a near tie
        p *= 8
    prompt = np.random.default_rng(2).integers(0, 13, (2, 5))
    ids, logits = model.generate(prompt, 10, temperature=0, return_logits=True)
    ids2, logits2 = model.generate(prompt, 10, temperature=0, use_cache=False, return_logits=True)
    np.testing.assert_array_equal(ids, ids2)
    np.testing.assert_allclose(logits, logits2, rtol=0, atol=1e-12)
    assert ids.shape == (2, 15) and logits.shape == (2, 10, 13)
    np.testing.assert_array_equal(ids[:, :5], prompt)
    assert model.training  # restored after generate's eval mode


def test_ragged_batch_equals_one_by_one():
    model = GPT(tiny(seed=4))
    for p in model.params.values():
        p *= 8
    r = np.random.default_rng(5)
    prompts = [r.integers(0, 13, n) for n in (1, 6, 3)]
    together, logits = model.generate(prompts, 5, temperature=0, return_logits=True)
    for n, p in enumerate(prompts):
        alone, lg = model.generate(p[None], 5, temperature=0, return_logits=True)
        np.testing.assert_array_equal(together[n], alone[0])
        np.testing.assert_allclose(logits[n], lg[0], rtol=0, atol=1e-12)
    assert isinstance(together, list) and [len(s) for s in together] == [6, 11, 8]


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
    model = GPT(tiny(dtype=np.float32, seed=6))
    prompt = np.array([1, 2, 3])
    a = model.generate(prompt, 8, temperature=0.9, top_k=4, rng=np.random.default_rng(0))
    b = model.generate(prompt, 8, temperature=0.9, top_k=4, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(a, b)
    assert a.shape == (11,)
    np.testing.assert_array_equal(model.generate(prompt, 8, top_k=1, rng=np.random.default_rng(1)),
                                  model.generate(prompt, 8, temperature=0))
    with pytest.raises(ShapeError, match="temperature"):
        model.generate(prompt, 2, temperature=-1)


def test_contract_errors():
    model = GPT(tiny())
    with pytest.raises(ShapeError, match="more than block_size"):
        model.forward(np.zeros((1, 13), dtype=np.int64))
    with pytest.raises(ShapeError, match=r"int array \(B, T\)"):
        model.forward(np.zeros((2, 3)))
    model.eval().loss(*batch(model.config))
    with pytest.raises(RuntimeError, match="training mode"):
        model.backward()
    model.train().forward(batch(model.config)[0])
    with pytest.raises(RuntimeError, match="needs loss"):
        model.backward()
    with pytest.raises(ShapeError, match="n_embd must be a multiple of n_head"):
        tiny(n_embd=15)
    assert model.num_params() == sum(p.size for p in model.params.values())
    assert model.num_params(non_embedding=True) == model.num_params() - 12 * 16


# --- Hugging Face GPT-2 --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    torch = pytest.importorskip("torch", reason="the GPT-2 parity test needs PyTorch: pip install -e '.[torch]'")
    transformers = pytest.importorskip("transformers", reason="the GPT-2 parity test needs pip install -e '.[hf]'")
    pytest.importorskip("safetensors", reason="load_gpt2 reads safetensors: pip install -e '.[models]'")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=24, n_embd=32, n_layer=2, n_head=4,
                                  bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    folder = tmp_path_factory.mktemp("gpt2")
    hf.save_pretrained(folder)
    return folder, hf


def test_load_gpt2_matches_transformers(gpt2_folder, tg):
    import torch

    folder, hf = gpt2_folder
    model = load_gpt2(folder)
    idx = np.random.default_rng(0).integers(0, 50, (2, 20))
    with torch.no_grad():
        want = hf(torch.from_numpy(idx)).logits.numpy()
        greedy = hf.generate(torch.from_numpy(idx[:, :6]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    np.testing.assert_allclose(model.forward(idx), want, rtol=0, atol=1e-4)
    np.testing.assert_array_equal(model.generate(idx[:, :6], 12, temperature=0), greedy.numpy())


def _edit(folder, dst, *, config=None, tensors=None):
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(folder, dst)
    if config is not None:
        raw = json.loads((dst / "config.json").read_text())
        config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    if tensors is not None:
        raw = load_file(str(dst / "model.safetensors"))
        tensors(raw)
        save_file(raw, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("edit,match", [
    (dict(config=lambda c: c.update(model_type="llama")), "model_type must be 'gpt2'"),
    (dict(config=lambda c: c.update(activation_function="relu")), "activation_function"),
    (dict(config=lambda c: c.update(scale_attn_by_inverse_layer_idx=True)), "scale_attn_by_inverse_layer_idx"),
    (dict(tensors=lambda t: t.pop("transformer.h.1.mlp.c_fc.bias")), "1 missing tensor.*h.1.mlp.c_fc.bias"),
    (dict(tensors=lambda t: t.update({"transformer.h.0.extra": np.zeros(2, np.float32)})), "unknown.*h.0.extra"),
    (dict(tensors=lambda t: t.update({"transformer.ln_f.weight": np.zeros(31, np.float32)})),
     r"ln_f.weight must have shape \(32,\)"),
    (dict(tensors=lambda t: t["transformer.wte.weight"].__setitem__((0, 0), np.nan)), "non-finite"),
])
def test_load_gpt2_refuses_anything_else(gpt2_folder, tmp_path, edit, match):
    folder, _ = gpt2_folder
    with pytest.raises(CheckpointError, match=match):
        load_gpt2(_edit(folder, tmp_path / "m", **edit))


def test_dropout_reaches_the_attention_weights():
    """GPTConfig.dropout drops attention weights too (nanoGPT's attn_dropout), in train() only:
    with the residual and embedding dropout turned off, train-mode losses still differ from
    eval mode's, repeat for the same seed, and backward gives finite gradients."""
    cfg = tiny(dropout=0.3)
    x, y = batch(cfg)

    def attention_dropout_only():
        m = GPT(cfg)
        for layer in [m.drop] + [d for blk in m.h for d in (blk.drop_1, blk.drop_2)]:
            layer.p = 0.0
        return m

    m = attention_dropout_only()
    assert all(blk.attn.dropout == 0.3 for blk in m.h)
    first = [m.loss(x, y) for _ in range(2)]
    m.backward()
    assert all(np.isfinite(g).all() for g in m.grads.values())
    m.eval()
    plain = m.loss(x, y)
    assert first[0] != first[1] and plain not in first           # new masks each call; none in eval()
    again = attention_dropout_only()
    assert [again.loss(x, y) for _ in range(2)] == first          # the seed repeats them
