"""What qkv.torch does per call besides the kernel: tensors cross as views, plain options are
checked once, and the Hugging Face backend translates a mask once a forward, never serving a
changed mask a stale translation."""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="qkv.torch needs PyTorch: pip install -e '.[torch]'")
qt = pytest.importorskip("qkv.torch")
import qkv  # noqa: E402
from qkv.torch import hf_masks, ops, options  # noqa: E402


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_to_numpy_is_a_view_of_contiguous_and_strided_tensors():
    base = torch.randn(2, 5, 3, 4)
    for t in (base, base.transpose(1, 2), base[:, ::2], base.transpose(-1, -2)):
        a = options.to_numpy(t)
        assert np.shares_memory(a, base.numpy()) and _ptr(a) == t.data_ptr() and a.strides == \
            tuple(s * t.element_size() for s in t.stride())
    out = np.ones((2, 3), np.float32)
    assert options.from_numpy(out).data_ptr() == _ptr(out)
    assert options.from_numpy(out, torch.float32).data_ptr() == _ptr(out)


def test_empty_slabs_are_numpys_where_numpy_has_the_dtype():
    """options.empty: a C-ordered, writable tensor of the shape and dtype asked (its
    memory NumPy's, which madvises huge pages for big arrays, for float16/32/64; torch's for
    bfloat16, which NumPy lacks), usable as an ``out=`` of the shape."""
    for dtype, shape in ((torch.float32, (2, 3, 5)), (torch.float64, (4, 1)), (torch.float16, (3, 0, 2)),
                         (torch.bfloat16, (2, 2))):
        t = options.empty(shape, dtype)
        assert t.dtype == dtype and tuple(t.shape) == shape and t.is_contiguous() and not t.requires_grad
        x = torch.arange(t.numel(), dtype=torch.float64).reshape(shape)
        assert torch.equal(torch.mul(x.to(dtype), 2, out=t), (2 * x).to(dtype)) and t.shape == shape


def test_backward_gets_views_and_gradients_come_back_without_a_copy(monkeypatch):
    seen = {}
    real = ops.np_attention_backward

    def spy(dout, q, k, v, out, lse, **kw):
        seen.update(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
        seen["grads"] = real(dout, q, k, v, out, lse, **kw)
        return seen["grads"]

    monkeypatch.setattr(ops, "np_attention_backward", spy)
    q = torch.randn(2, 6, 3, 4).transpose(1, 2).requires_grad_(True)  # (B, T, H, D) memory, as HF's
    k, v = (torch.randn(2, 3, 6, 4, requires_grad=True) for _ in range(2))
    out, lse = qt.attention(q, k, v, causal=True, return_lse=True)
    dout = torch.randn(2, 6, 3, 4).transpose(1, 2)
    out.backward(dout)
    assert _ptr(seen["q"]) == q.data_ptr() and _ptr(seen["dout"]) == dout.data_ptr()
    assert _ptr(seen["out"]) == out.data_ptr() and _ptr(seen["lse"]) == lse.data_ptr()
    dq, dk, dv = seen["grads"]
    assert k.grad.data_ptr() == _ptr(dk) and v.grad.data_ptr() == _ptr(dv)


def test_plain_options_are_encoded_once_and_their_types_kept_apart(monkeypatch):
    options._encoded.clear()
    count = []
    real = options._encode
    monkeypatch.setattr(options, "_encode", lambda o: count.append(o) or real(o))
    a = options.encode(dict(causal="bottom_right", gqa=True, scale=0.25))
    b = options.encode(dict(scale=0.25, gqa=True, causal="bottom_right"))
    assert a == b and len(count) == 1
    assert options.decode(a) == options.decode(a) and options.decode(a)["causal"] == "bottom_right"
    with pytest.raises(qkv.ShapeError, match="gqa must be True or False"):
        options.encode(dict(gqa=1))  # equal to True, but not True: checked, not served True's encoding
    options.encode(dict(window=(3, 0)))
    with pytest.raises(qkv.ShapeError):
        options.encode(dict(window=(3.5, 0)))
    mask = torch.ones(3, 3, dtype=torch.bool)
    options.encode(dict(mask=mask))
    options.encode(dict(mask=mask))
    assert sum("mask" in o for o in count) == 2  # options with tensors are encoded each call
    decoded = options.decode(options.encode(dict(mask=mask)))
    assert np.shares_memory(decoded["mask"], mask.numpy())


def test_a_mask_is_translated_once_and_a_changed_one_again(monkeypatch):
    hf_masks._kept.clear()
    count = []
    real = hf_masks.translate
    monkeypatch.setattr(hf_masks, "translate", lambda *a: count.append(a) or real(*a))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, 7:] = False  # right padding
    first = hf_masks.read_mask(mask, 2, 10, 10, True)
    assert first["kv_lengths"].tolist() == [7, 10]
    for _ in range(3):  # every layer of one forward
        again = hf_masks.read_mask(mask, 2, 10, 10, True)
        assert again["kv_lengths"] is first["kv_lengths"]
    assert len(count) == 1
    again["extra"] = 1  # a caller's changes to what it got do not reach the kept translation
    assert "extra" not in hf_masks.read_mask(mask, 2, 10, 10, True)

    mask[1, 5:] = False  # changed in place: its version moved on
    assert hf_masks.read_mask(mask, 2, 10, 10, True)["kv_lengths"].tolist() == [7, 5]
    assert len(count) == 2
    one_query = hf_masks.read_mask(mask, 2, 1, 10, True)  # other sizes: translated for them
    assert len(count) == 3 and one_query["mask"].shape == (2, 1, 1, 10) and "kv_lengths" not in one_query

    del mask, first, again
    hf_masks._kept.clear()
    for lengths in ([4, 10], [10, 10], [2, 3]):  # new masks, likely at the freed masks' addresses
        m = torch.arange(10) < torch.tensor(lengths)[:, None]
        got = hf_masks.read_mask(m, 2, 10, 10, True)
        assert got.get("kv_lengths", torch.tensor([10, 10])).tolist() == lengths
        del m


def test_inference_mode_masks_are_translated_every_call(monkeypatch):
    hf_masks._kept.clear()
    with torch.inference_mode():
        mask = torch.ones(2, 8, dtype=torch.bool)
        mask[1, 6:] = False
        assert hf_masks.read_mask(mask, 2, 8, 8, True)["kv_lengths"].tolist() == [8, 6]
        mask[0, 4:] = False  # in place, with no version counted
        assert hf_masks.read_mask(mask, 2, 8, 8, True)["kv_lengths"].tolist() == [4, 6]
    assert not hf_masks._kept


def test_one_translation_a_forward_in_a_model_equal_to_eager(monkeypatch):
    transformers = pytest.importorskip("transformers", reason="pip install -e '.[hf]'")
    name = qt.register_hf()
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    models = []
    for impl in ("eager", name):
        c = copy.deepcopy(config)
        c._attn_implementation = impl
        torch.manual_seed(0)
        models.append(transformers.LlamaForCausalLM(c).eval())
    eager, ours = models
    count = []
    real = hf_masks.translate
    monkeypatch.setattr(hf_masks, "translate", lambda *a: count.append(a) or real(*a))
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(0))
    pad = torch.ones(2, 12, dtype=torch.long)
    for cut in (9, 5):  # two forwards, two paddings: each translated once for the three layers
        pad[0, cut:] = 0
        a = ours(ids, attention_mask=pad, use_cache=False).logits
        b = eager(ids, attention_mask=pad, use_cache=False).logits
        assert (a - b)[pad.bool()].abs().max().item() <= 1e-4
    assert len(count) == 2


def test_a_call_without_gradients_runs_the_kernel_directly_with_the_operators_bits(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []
    real = ops.fwd
    monkeypatch.setattr(ops, "fwd", lambda *a: calls.append(1) or real(*a))
    q, k, v = (torch.randn(2, 3, 6, 4) for _ in range(3))
    with torch.no_grad():
        direct = qt.attention(q, k, v, causal=True)
    assert not calls
    assert torch.equal(direct, real(q, k, v, *options.encode(dict(causal=True)), False)[0])
    qt.attention(q, k, v.requires_grad_(True), causal=True)  # a gradient wanted: the operator
    assert len(calls) == 1
    with torch.no_grad():
        seen = []

        class Log(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append(str(func))
                return func(*args, **(kwargs or {}))

        with Log():  # a mode that records calls sees the operator
            qt.attention(q, k, v, causal=True)
        assert len(calls) == 2 and any("qkv.attention_fwd" in f for f in seen)
        with torch.device("cpu"):  # a function mode
            qt.attention(q, k, v, causal=True)
        assert len(calls) == 3
