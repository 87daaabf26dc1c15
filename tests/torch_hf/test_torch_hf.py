"""attn_implementation="qkv" in Hugging Face transformers: the offline all-MiniLM-L6-v2 on a
padded batch, and Llama (GQA + RoPE) and Mistral (sliding window) decoders built from small
configs with random weights (no download), forward and greedy generate() with the cache."""
import copy

import pytest

torch = pytest.importorskip("torch", reason="qkv.torch needs PyTorch: pip install -e '.[torch]'")
transformers = pytest.importorskip("transformers", reason="the Hugging Face hook needs transformers: "
                                                          "pip install -e '.[hf]'")
qt = pytest.importorskip("qkv.torch")
from qkv.torch import hf  # noqa: E402

NAME = qt.register_hf()


@pytest.fixture
def calls(monkeypatch):
    """The options each layer passed to qkv.torch.attention, with its Tq and Tk."""
    seen = []
    real = hf.attention

    def spy(q, k, v, **options):
        seen.append(dict(options, Tq=q.shape[-2], Tk=k.shape[-2]))
        return real(q, k, v, **options)

    monkeypatch.setattr(hf, "attention", spy)
    return seen


def test_minilm_padded_batch_matches_eager(calls):
    models = pytest.importorskip("qkv.models")
    try:
        path = models.default_model_path()
    except Exception as err:  # the checkpoint comes with the models extra
        pytest.skip(f"the offline all-MiniLM-L6-v2 is not installed: {err}")
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    batch = tok(["A man is playing a guitar.", "Hi",
                 "The animal didn't cross the street because it was too tired."], padding=True, return_tensors="pt")
    eager = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    ours = AutoModel.from_pretrained(path, attn_implementation=NAME).eval()
    exact = copy.deepcopy(eager).double()
    with torch.no_grad():
        h_eager = eager(**batch).last_hidden_state
        h_ours = ours(**batch).last_hidden_state
        h_exact = exact(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    assert (h_ours - h_eager)[real].abs().max().item() <= 2e-5
    # padding rows carry no meaning; there eager itself errs ~2e-5 against float64, and qkv may
    # err at most twice what eager does (DESIGN.md's budget)
    eager_err = (h_eager.double() - h_exact).abs().max().item()
    assert (h_ours.double() - h_exact).abs().max().item() <= 2 * eager_err
    assert calls and all("kv_lengths" in c and "mask" not in c and "causal" not in c for c in calls)


def tiny(kind, **extra):
    common = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128)
    if kind == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(**common, **extra)
    return transformers.MistralForCausalLM, transformers.MistralConfig(**common, sliding_window=6, **extra)


def twins(kind):
    cls, config = tiny(kind)
    models = []
    for impl in ("eager", NAME):
        c = copy.deepcopy(config)
        c._attn_implementation = impl
        torch.manual_seed(0)
        models.append(cls(c).eval())
    return models


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_decoder_logits_and_greedy_generate_match_eager(kind, calls):
    eager, ours = twins(kind)
    assert ours.config._attn_implementation == NAME and eager.config._attn_implementation == "eager"
    ids = torch.randint(0, 101, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids).logits - eager(ids).logits).abs().max().item() <= 1e-4
    structured = dict(causal="bottom_right", gqa=True)
    if kind == "mistral":
        structured["window"] = (5, 0)  # sliding_window 6: keys j > i - 6
    assert all(c.items() >= structured.items() and "mask" not in c for c in calls)

    calls.clear()
    pad = torch.ones(2, 14, dtype=torch.long)
    pad[1, :3] = 0  # left padding, as for batched generation
    for mask in (None, pad):
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        if mask is not None:
            kw["attention_mask"] = mask
        assert torch.equal(ours.generate(ids, **kw), eager.generate(ids, **kw))
    decode = [c for c in calls if c["Tq"] == 1]
    assert decode and all(c["causal"] == "bottom_right" and c["gqa"] for c in decode)
    if kind == "mistral":  # the window is passed wherever a query reaches past it (more than 6 keys)
        assert all(c.get("window") == (5, 0) for c in calls if c["Tk"] > 6)


def test_right_padding_becomes_kv_lengths_and_other_masks_go_dense(calls):
    eager, ours = twins("llama")
    ids = torch.randint(0, 101, (2, 10), generator=torch.Generator().manual_seed(2))
    right = torch.ones(2, 10, dtype=torch.long)
    right[0, 7:] = 0
    with torch.no_grad():
        a, b = ours(ids, attention_mask=right).logits, eager(ids, attention_mask=right).logits
    assert (a - b)[right.bool()].abs().max().item() <= 1e-4
    assert calls and all(c["kv_lengths"].tolist() == [7, 10] for c in calls)

    # a pattern qkv does not take as structure (here an extra mask function) goes dense
    extra = lambda b, h, q, kv: kv != 2  # noqa: E731
    out = hf.hf_mask(2, 10, 10, mask_function=transformers.masking_utils.and_masks(
        transformers.masking_utils.causal_mask_function, extra))
    assert out.shape == (2, 1, 10, 10) and out.dtype == torch.bool and not out[:, :, :, 2].any()
    window = transformers.masking_utils.sliding_window_causal_mask_function(4)
    assert hf.plain_pattern(window) == ("sliding", 4)
    reach = hf.hf_mask(2, 10, 10, mask_function=window)  # the window as each key's reach
    assert reach.shape == (2, 10) and reach.dtype == torch.int32 and (reach == 4).all()
    assert hf.hf_mask(2, 4, 4, mask_function=window) is None  # no query reaches past 4 keys
    assert hf.hf_mask(2, 1, 10, q_offset=3, kv_offset=0, mask_function=window).shape == (2, 1, 1, 10)


def test_dropout_in_training_drops_weights_and_torch_manual_seed_repeats_it():
    """A model in training mode passes its attention dropout: qkv drops weights with a seed
    from torch's generator (eval() passes 0.0: no dropout)."""
    _, ours = twins("llama")
    ours = copy.deepcopy(ours)
    ours.config.attention_dropout = 0.5
    for layer in ours.model.layers:
        layer.self_attn.attention_dropout = 0.5
    ids = torch.arange(2, 10)[None]
    with torch.no_grad():
        plain = ours.eval()(ids).logits
        ours.train()
        torch.manual_seed(3)
        first = ours(ids).logits
        torch.manual_seed(3)
        again = ours(ids).logits
    assert torch.equal(first, again) and not torch.allclose(first, plain)


def test_a_2d_mask_made_again_from_itself_is_the_same():
    """generate() with a static cache makes the masks, then the model makes them again from
    what it got (a 2-D mask reads as a user's padding mask): cut from the right only, a qkv
    2-D mask is its own fixed point (a mask cut at kv_offset was cut twice: wrong tokens)."""
    mu = transformers.masking_utils
    padding = torch.ones(2, 13, dtype=torch.bool)
    padding[1, :3] = False
    for window, q, kv, q_off, kv_off in [(8, 1, 8, 12, 5), (8, 13, 13, 0, 0), (None, 1, 13, 12, 0)]:
        pattern = mu.causal_mask_function if window is None else mu.sliding_window_causal_mask_function(window)
        first = hf.hf_mask(2, q, kv, q_offset=q_off, kv_offset=kv_off, mask_function=pattern, attention_mask=padding)
        again = hf.hf_mask(2, q, kv, q_offset=q_off, kv_offset=kv_off, mask_function=pattern,
                           attention_mask=first.to(torch.bool))
        assert first.shape == (2, 13) and torch.equal(first, again)


def test_a_sliding_window_read_under_compile_is_transformers_mask():
    """An int32 window mask made eagerly (generate makes masks outside the compiled forward)
    and read under torch.compile becomes the dense mask transformers makes for the pattern."""
    from qkv.torch import hf_masks

    mu = transformers.masking_utils
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[1, :3] = False
    for q, kv, q_off, kv_off in [(12, 12, 0, 0), (1, 8, 11, 4)]:
        pattern = mu.sliding_window_causal_mask_function(5)
        theirs = mu.sdpa_mask(2, q, kv, q_offset=q_off, kv_offset=kv_off, mask_function=pattern,
                              attention_mask=padding, allow_is_causal_skip=False)
        reach = hf.hf_mask(2, q, kv, q_offset=q_off, kv_offset=kv_off, mask_function=pattern, attention_mask=padding)
        assert torch.equal(hf_masks._sliding_mask(reach, q, kv), theirs)

    class Layer(torch.nn.Module):
        is_causal = True

    q, k = torch.randn(2, 4, 12, 8), torch.randn(2, 2, 12, 8)
    reach = hf.hf_mask(2, 12, 12, mask_function=mu.sliding_window_causal_mask_function(5), attention_mask=padding)
    compiled = torch.compile(lambda *a: hf.hf_attention(Layer(), *a, scaling=None)[0], fullgraph=True,
                             backend="aot_eager")
    real = padding.bool()
    assert (compiled(q, k, k, reach) - hf.hf_attention(Layer(), q, k, k, reach)[0])[real].abs().max() <= 1e-6


def test_softcapping_reaches_qkv():
    """Gemma 2 caps its attention logits (softcap=50 by default): qkv caps them too, as eager does."""
    config = transformers.Gemma2Config(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       attn_logit_softcapping=5.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    eager = transformers.Gemma2ForCausalLM(config).eval()
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation(NAME)
    ids = torch.arange(2, 12)[None]
    with torch.no_grad():
        assert (ours(ids).logits - eager(ids).logits).abs().max().item() <= 1e-4


def test_torch_names_get_qkvs_name_in_the_error():
    import qkv

    x = torch.zeros(1, 2, 3, 4)
    with pytest.raises(qkv.ShapeError, match=r"an unknown keyword argument is_causal= \(qkv's name: causal=True"):
        qt.attention(x, x, x, is_causal=True)


def test_registering_twice_checks_once():
    """register_hf wraps PreTrainedModel's two checks once, however often it is called."""
    wrapped = transformers.PreTrainedModel.get_correct_attn_implementation
    assert qt.register_hf() == NAME and transformers.PreTrainedModel.get_correct_attn_implementation is wrapped
