"""attn_implementation="qkv" across Hugging Face model families: tiny random models (2 layers,
width 64, vocab 101, GQA where the family has it, sliding windows smaller than the input),
each against eager attention on the same weights: logits in float32 and float64, greedy
generation with a dynamic and a static cache on a batch with a left-padded row, and float64
gradients. A family that cannot use transformers' attention interface (Falcon) must refuse
qkv with a ValueError, at build time and at set_attn_implementation."""
import copy
import math

import pytest

torch = pytest.importorskip("torch", reason="qkv.torch needs PyTorch: pip install -e '.[torch]'")
transformers = pytest.importorskip("transformers", reason="the Hugging Face hook needs transformers: "
                                                          "pip install -e '.[hf]'")
qt = pytest.importorskip("qkv.torch")

NAME = qt.register_hf()
VOCAB, T, PAD = 101, 16, 3  # input length, and left padding of the second row
WINDOW = 8  # every windowed family's: smaller than the input
PROMPTS = {"short": (6, 2), "long": (12, 3)}  # generation: prompt length and left padding
NEW = 8  # generated tokens: a short prompt grows past the window, with its padding in it for a while
DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               bos_token_id=None, eos_token_id=None, pad_token_id=0)
HYBRID = ["sliding_attention", "full_attention"]

# family: (config class, model class, config keywords, the config attribute of its window or None)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(DECODER), None),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(DECODER, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                       experts_implementation="eager"),  # grouped_mm has no float64
                  "sliding_window"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(DECODER, head_dim=16), None),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(DECODER, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, layer_types=HYBRID,
                    attn_logit_softcapping=None, final_logit_softcapping=None), "sliding_window"),
    "gemma2_softcap": ("Gemma2Config", "Gemma2ForCausalLM",  # the default config's caps: attention 50, final 30
                       dict(DECODER, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                            layer_types=HYBRID), "sliding_window"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(DECODER, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, layer_types=HYBRID,
                    attn_logit_softcapping=None, final_logit_softcapping=None), "sliding_window"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(DECODER, sliding_window=WINDOW), "sliding_window"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=None,
                  eos_token_id=None, pad_token_id=0, tie_word_embeddings=False), None),  # tied: one token
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                 dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
                      pad_token_id=0), None),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(DECODER), None),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM",
                dict(DECODER, sliding_window=WINDOW, layer_types=HYBRID,
                     tie_word_embeddings=False), "sliding_window"),  # tied, it repeats one token
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(DECODER), None),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(DECODER, sliding_window=WINDOW), "sliding_window"),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM",
                dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64, pad_token_id=1), None),
    "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM",
                   dict(vocab_size=VOCAB, dim=64, hidden_dim=128, n_layers=2, n_heads=4, max_position_embeddings=64,
                        pad_token_id=0), None),
}
ENCODERS = {"roberta", "distilbert"}
WINDOWED = [f for f, spec in FAMILIES.items() if spec[3]]


def family(name, impl="eager", **change):
    """A tiny random model of the family on ``impl``, its weights fixed by the seed."""
    config_name, model_name, kwargs, _ = FAMILIES[name]
    if not hasattr(transformers, config_name) or not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    config = getattr(transformers, config_name)(**kwargs)
    for key, value in change.items():
        setattr(config, key, value)
    config._attn_implementation = impl
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).eval()


@pytest.fixture(scope="module")
def twins():
    """(eager, qkv) models of a family with the same weights, built once per family (qkv's
    by set_attn_implementation; tests/torch_hf/test_torch_hf.py builds models on qkv directly)."""
    made = {}

    def get(name):
        if name not in made:
            eager = family(name)
            ours = copy.deepcopy(eager)
            ours.set_attn_implementation(NAME)
            assert ours.config._attn_implementation == NAME and eager.config._attn_implementation == "eager"
            made[name] = eager, ours
        return made[name]
    return get


def batch(name, length=T, pad=PAD):
    """Token ids (B, length) and the attention mask: row 0 unpadded, row 1 left-padded; an
    encoder also gets a right-padded row 2."""
    pad_id = FAMILIES[name][2]["pad_token_id"]
    rows = 3 if name in ENCODERS else 2
    ids = torch.randint(2, VOCAB, (rows, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1, :pad] = 0
    if name in ENCODERS:
        mask[2, length - pad:] = 0
    return ids.masked_fill(mask == 0, pad_id), mask


@pytest.fixture
def float64_eager(monkeypatch):
    """Most families' eager attention takes its softmax in float32 whatever the model's dtype
    (``softmax(..., dtype=torch.float32)``): there, in float64, eager errs ~1e-8 and a fully
    masked (left-padding) row becomes NaN (float64's min is -inf in float32). This keeps the
    softmax of a float64 tensor in float64, so that eager is a float64 reference."""
    real = torch.nn.functional.softmax

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        return real(input, dim=dim, dtype=None if input.dtype == torch.float64 else dtype)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax)


def logits(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_eager_in_float32_and_float64(name, twins, float64_eager):
    eager, ours = twins(name)
    ids, mask = batch(name)
    real = mask.bool()
    with torch.no_grad():
        assert (logits(ours, ids, mask) - logits(eager, ids, mask))[real].abs().max().item() <= 1e-4
        assert (logits(ours, ids[:1], None) - logits(eager, ids[:1], None)).abs().max().item() <= 1e-4
        exact_eager, exact_ours = copy.deepcopy(eager).double(), copy.deepcopy(ours).double()
        assert (logits(exact_ours, ids, mask) - logits(exact_eager, ids, mask))[real].abs().max().item() <= 1e-10


@pytest.mark.parametrize("name", WINDOWED)
def test_the_window_matters_in_windowed_families(name, twins):
    """Without its window the same model gives other logits: the tests above can fail."""
    eager, _ = twins(name)
    wide = family(name, **{FAMILIES[name][3]: 10 * T})
    wide.load_state_dict(eager.state_dict())
    ids, mask = batch(name)
    with torch.no_grad():
        assert (logits(wide, ids, mask) - logits(eager, ids, mask))[mask.bool()].abs().max().item() > 1e-3


GENERATE = [(name, prompt) for name in FAMILIES if name not in ENCODERS
            for prompt in (PROMPTS if name in WINDOWED else ["short"])]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name, prompt", GENERATE)
def test_greedy_generation_matches_eager(name, prompt, cache, twins):
    """A short prompt fits the window, the tokens it generates do not; a long one does not."""
    eager, ours = twins(name)
    ids, mask = batch(name, *PROMPTS[prompt])
    kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    assert torch.equal(ours.generate(ids, **kw), eager.generate(ids, **kw))


@pytest.mark.parametrize("name", FAMILIES)
def test_float64_gradients_match_eager(name, twins, float64_eager):
    ids, mask = batch(name)
    real = mask.bool()
    grads = []
    for model in twins(name):
        model = copy.deepcopy(model).double()
        out = logits(model, ids, mask)
        torch.nn.functional.cross_entropy(out[real], ids[real]).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    eager, ours = grads
    assert eager.keys() == ours.keys()
    scale = max(g.abs().max().item() for g in eager.values())
    worst = max((ours[n] - g).abs().max().item() for n, g in eager.items())
    assert worst <= 1e-8 * scale


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_model_matches_eager_fullgraph(backend, twins):
    """torch.compile(fullgraph=True) traces the mask and attention functions (Mistral: a
    sliding window smaller than the input, and a left-padded row). aot_eager traces what
    inductor does (dynamo, the fake kernels, autograd) in ~4 s; inductor's code generation
    adds ~20 s on 2 cores the first time."""
    eager, ours = twins("mistral")
    ids, mask = batch("mistral")
    compiled = torch.compile(ours, fullgraph=True, backend=backend)
    with torch.no_grad():
        assert (logits(compiled, ids, mask) - logits(eager, ids, mask))[mask.bool()].abs().max().item() <= 1e-4


def test_falcon_on_qkv_as_its_attention_allows():
    """Falcon's attention called no AttentionInterface before transformers 5.25 (qkv would never
    run: building or switching it raises, naming qkv and the model); from 5.25 it does, and on
    qkv it gives eager attention's logits. Which one holds is transformers' own sign."""
    if not hasattr(transformers, "FalconForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Falcon")
    config = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(config).eval()
    if not transformers.FalconForCausalLM._can_set_attn_implementation():
        refused = copy.deepcopy(config)
        refused._attn_implementation = NAME
        with pytest.raises(ValueError, match=r"qkv.*FalconForCausalLM"):
            transformers.FalconForCausalLM(refused)
        with pytest.raises(ValueError, match=r"qkv.*Falcon"):
            model.set_attn_implementation(NAME)
        assert model.config._attn_implementation == "eager"
        return
    ids = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        want = model(ids).logits
        on_qkv = copy.deepcopy(model)
        on_qkv.set_attn_implementation(NAME)
        assert on_qkv.config._attn_implementation == NAME
        got = on_qkv(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_gemma2_default_config_caps_its_logits_at_50():
    config = transformers.Gemma2Config(**FAMILIES["gemma2_softcap"][2])
    assert config.attn_logit_softcapping == 50.0


def _gpt2_steps(seed: int, steps: int = 3):
    """A few SGD steps of GPT-2 with attn_pdrop=0.1 in training mode on qkv; the losses and
    the last step's gradients."""
    model = family("gpt2", NAME, attn_pdrop=0.1, resid_pdrop=0.0, embd_pdrop=0.0).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids, mask = batch("gpt2")
    torch.manual_seed(seed)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gpt2_trains_with_attention_dropout_on_qkv():
    losses, grads = _gpt2_steps(5)
    again, grads_again = _gpt2_steps(5)
    other, _ = _gpt2_steps(6)
    assert all(torch.isfinite(g).all() for g in grads.values()) and all(map(math.isfinite, losses))
    assert losses == again and all(torch.equal(g, grads_again[n]) for n, g in grads.items())  # torch.manual_seed repeats it
    assert other != losses  # another seed, another keep-mask
    model = family("gpt2", NAME, attn_pdrop=0.1)
    ids, mask = batch("gpt2")
    with torch.no_grad():
        assert model(input_ids=ids, attention_mask=mask).logits.isfinite().all()


# encoder-decoder families whose attention adds a learned relative-position bias (T5's buckets)
SEQ2SEQ = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
               relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
BIASED = {
    "t5": ("T5Config", "T5ForConditionalGeneration", {}),
    "mt5": ("MT5Config", "MT5ForConditionalGeneration", {}),
    "umt5": ("UMT5Config", "UMT5ForConditionalGeneration", {}),  # a bias in every layer
    "longt5": ("LongT5Config", "LongT5ForConditionalGeneration", {}),
    "switch": ("SwitchTransformersConfig", "SwitchTransformersForConditionalGeneration",
               dict(num_experts=2, expert_capacity=64, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                    router_jitter_noise=0.0)),  # the router's noise would draw differently in the two models
}


@pytest.mark.parametrize("name", BIASED)
def test_learned_bias_families_train_on_qkv_with_eagers_loss_and_gradients(name, float64_eager):
    """T5 & co. add a learned relative-position bias to the scores: in training mode (float64)
    qkv gives eager's loss and every gradient, the bias's embedding included."""
    config_name, model_name, extra = BIASED[name]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    config = getattr(transformers, config_name)(**SEQ2SEQ, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    eager = getattr(transformers, model_name)(config).double().train()
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation(NAME)
    ids = torch.randint(2, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    labels = torch.randint(2, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    losses, grads = [], []
    for model in (eager, ours):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert abs(losses[0] - losses[1]) <= 1e-10
    assert grads[0].keys() == grads[1].keys()
    assert max((grads[1][n] - g).abs().max().item() for n, g in grads[0].items()) <= 1e-10
    learned = [n for n in grads[1] if "relative_attention_bias" in n]
    assert learned and all(grads[1][n].abs().max() > 1e-6 for n in learned)


def _llama_step(impl):
    """One training forward and backward of a tiny Llama under CPU bfloat16 autocast: the loss,
    the logits' dtype and the gradients (RoPE leaves q, k in float32 and v in bfloat16)."""
    config = transformers.LlamaConfig(**DECODER)
    config._attn_implementation = impl
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids, _ = batch("qwen2")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.item(), out.logits.dtype, {n: p.grad for n, p in model.named_parameters()}


def test_llama_trains_under_cpu_autocast_as_sdpa_does():
    """Autocast casts SDPA's q, k, v to bfloat16 (its lower-precision list); qkv takes what
    autocast leaves (float32 q, k and a bfloat16 v) the same way: a bfloat16 output, float32
    gradients, the loss and gradients of sdpa within bfloat16's rounding."""
    loss, dtype, grads = _llama_step(NAME)
    want_loss, want_dtype, want = _llama_step("sdpa")
    assert dtype == want_dtype == torch.bfloat16
    assert abs(loss - want_loss) <= 1e-3 * abs(want_loss)
    for n, g in want.items():
        assert grads[n].dtype == g.dtype == torch.float32 and torch.isfinite(grads[n]).all()
        assert (grads[n] - g).abs().max() <= 0.05 * g.abs().max(), n


def test_gpt2_trains_with_attention_dropout_under_fullgraph_compile():
    """Attention dropout without a seed in a compiled training step (fullgraph=True): qkv draws
    the seed inside the graph, so the same torch.manual_seed gives eager's loss and gradients."""
    model = family("gpt2", NAME, attn_pdrop=0.1, resid_pdrop=0.0, embd_pdrop=0.0).train()
    ids, mask = batch("gpt2")

    def step(fn):
        model.zero_grad()
        torch.manual_seed(7)
        out = fn(input_ids=ids, attention_mask=mask).logits  # the loss outside (HF's logs a warning in it)
        loss = torch.nn.functional.cross_entropy(out[mask.bool()], ids[mask.bool()])
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    torch._dynamo.reset()
    loss, grads = step(torch.compile(model, fullgraph=True, backend="aot_eager"))
    want, want_grads = step(model)
    assert abs(loss - want) <= 1e-6 * abs(want)
    assert all(torch.allclose(grads[n], g, rtol=1e-5, atol=1e-6) for n, g in want_grads.items())
    torch.manual_seed(8)
    with torch.no_grad():
        other = torch.nn.functional.cross_entropy(model(input_ids=ids, attention_mask=mask).logits[mask.bool()],
                                                  ids[mask.bool()]).item()
    assert abs(other - want) > 1e-6  # another seed, another mask: the dropout bites


@pytest.mark.parametrize("name", ["qwen2", "mistral", "roberta"])
def test_output_attentions_returns_eagers_weights(name, twins):
    """output_attentions=True: each layer's weights (B, Hq, Tq, Tk), as eager returns them (sdpa
    warns and returns none); they carry no gradient, and a training call says so."""
    eager, ours = twins(name)
    ids, mask = batch(name)
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        got = ours(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(got) == len(want) == 2
    real = mask.bool()[:, None, :, None]  # eager's weights of padding query rows are arbitrary
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert (a - b).masked_fill(~real, 0).abs().max().item() <= 1e-5
    with pytest.warns(UserWarning, match="without a gradient"):
        ours(input_ids=ids, attention_mask=mask, output_attentions=True)
