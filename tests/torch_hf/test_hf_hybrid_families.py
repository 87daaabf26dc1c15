"""Every transformers family whose modeling code calls the replaceable recurrent kernel functions,
as a tiny random config (tests/hf_hybrid.py), built twice with the same seed: transformers' torch
path, and the same model under ``register_hf(recurrent=True)`` (qkv.torch.hf_kernels).

float64 (transformers' float32 casts kept float64, recurrent_hf.float64): logits, loss and every
parameter gradient to 1e-9; float32: qkv within twice the torch path's own float32 error; greedy
generation with the cache token for token; a left-padded batch and packed sequences equal to
each sequence alone (packed on qkv's attention too, but in the families of ``EAGER_WHEN_PACKED``,
whose attention qkv's attention function cannot serve). A family that calls a function
qkv.torch.hf_kernels does not have yet skips naming it. ``QKV_HF_STANDIN=1`` serves the functions
with transformers' own torch fallbacks (the harness checking itself; the packed test skips there:
the fallbacks cannot take them).
"""
from __future__ import annotations

import importlib
import os
import sys
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_hybrid as H  # noqa: E402
from recurrent_hf import float64, rel  # noqa: E402

from qkv.torch import hf_recurrent  # noqa: E402

FAMILIES = list(H.FAMILIES)
STANDIN = os.environ.get("QKV_HF_STANDIN") == "1"
# selective_scan_fn (mamba_ssm's and transformers') has no seq_idx / cu_seqlens: a packed row
# cannot be kept apart by these families' Mamba-1 layers
NO_PACKING = {"Mamba", "FalconMamba", "Jamba", "Zamba"}   # Mamba-1: selective_scan_fn takes no seq_idx (nor mamba_ssm's)
# families that run everything else but cannot keep packed sequences apart in transformers' own code
PACKING_SKIPPED = {
    "Inkling": "transformers' Inkling does not hand seq_idx to its short convolutions (InklingAttention calls "
               "k_sconv / v_sconv, InklingDecoderLayer attn_sconv / mlp_sconv, with cache and conv_mask only; "
               "causal_conv1d_fn gets activation alone), so a packed row's second sequence sees the first's "
               "last tokens through each convolution",
}
# families whose attention qkv's attention function cannot serve: their packed check keeps eager
# attention, where transformers keeps packed sequences apart from the restarting position_ids (no
# cache) as a mask; the recurrent functions are still qkv's
EAGER_WHEN_PACKED = {
    "Inkling2": "its attention passes per-token sinks (sinks=), which qkv's attention function refuses",
    "Inkling2-Loop": "its attention passes per-token sinks (sinks=), which qkv's attention function refuses",
}


@pytest.mark.parametrize("family", sorted(EAGER_WHEN_PACKED))
def test_attention_sinks_are_refused_by_name_on_qkv_attention(family):
    """qkv's attention function does not compute attention sinks: a model whose layers pass them
    fails naming them (it once ignored them: logits off by 3-6 %)."""
    import qkv
    import qkv.torch
    qkv.torch.register_hf()
    model = H.build(family)
    model.set_attn_implementation("qkv")
    with pytest.raises(qkv.ShapeError, match="sinks .*attention sinks.* not a qkv option"):
        model(torch.randint(1, 97, (1, 9)))


def test_qwen4_exp_indexed_attention_runs_on_qkv_attention():
    """Qwen4-Exp's indexed attention asks for the whole mask (allow_is_causal_skip=False) and lays
    its token selection over it; qkv's mask function gives it that mask, and the logits are
    eager's (it once crashed on the None qkv returns for a plain causal pattern)."""
    import qkv.torch
    qkv.torch.register_hf()
    ids = torch.randint(1, 97, (2, 11), generator=torch.Generator().manual_seed(5))
    eager = H.build("Qwen4-Exp", dtype=torch.float64)
    on_qkv = H.build("Qwen4-Exp", dtype=torch.float64)
    on_qkv.set_attn_implementation("qkv")
    with torch.no_grad(), float64([H.modeling_module(eager)]):    # eager's float32 softmax kept float64
        assert rel(on_qkv(ids).logits, eager(ids).logits) <= 1e-12
STANDIN_SOURCES = {"fla": ("qwen3_next", "kimi_linear"), "mamba_ssm": ("mamba2", "falcon_mamba"),
                   "causal_conv1d": ("mamba2",)}


def _standin_module():
    """A stand-in for qkv.torch.hf_kernels: transformers' own torch fallback of each function."""
    fake = types.ModuleType(hf_recurrent.KERNELS_MODULE)
    for package, families in STANDIN_SOURCES.items():
        for fam in families:
            module = importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")
            for obj in vars(module).values():
                name = hf_recurrent.kernel_name(getattr(obj, "__wrapped__", obj))
                if name is not None and not hasattr(fake, name):
                    setattr(fake, name, _unwrap(obj))
    return fake


def _unwrap(obj):
    """transformers' torch function under the decorators (kernels' module, transformers' wrapper)."""
    import inspect

    fn = obj
    if isinstance(obj, torch.nn.Module):  # the kernels library's function module closes over func
        forward = type(obj).forward
        fn = forward.__closure__[forward.__code__.co_freevars.index("func")].cell_contents
    return inspect.unwrap(fn)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if STANDIN:
        saved = sys.modules.get(hf_recurrent.KERNELS_MODULE)
        sys.modules[hf_recurrent.KERNELS_MODULE] = _standin_module()
        yield
        if saved is None:
            sys.modules.pop(hf_recurrent.KERNELS_MODULE)
        else:
            sys.modules[hf_recurrent.KERNELS_MODULE] = saved
    else:
        yield


def pair(family, dtype=torch.float64):
    """(transformers' model, the same weights under qkv), skipping where a function is missing."""
    ref = H.build(family, dtype=dtype)
    missing = [n for n in H.functions_used(ref) if hf_recurrent.qkv_function(n) is None]
    if missing:
        pytest.skip(f"{family}: qkv.torch.hf_kernels has no {', '.join(missing)} yet")
    ours = H.build(family, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def ids(B=2, T=13, seed=1):
    return torch.randint(1, 97, (B, T), generator=torch.Generator().manual_seed(seed))


def run(model, qkv: bool, fn):
    """``fn()`` with the model's recurrent functions on qkv's or on transformers' own."""
    extra = [H.modeling_module(model)]
    with hf_recurrent.hf_recurrent_kernels(qkv):
        if next(model.parameters()).dtype == torch.float64:
            with float64(extra):
                return fn()
        return fn()


@pytest.mark.parametrize("family", FAMILIES)
def test_float64_logits_loss_and_every_gradient(family):
    ref, ours = pair(family)
    x = ids()
    results = []
    for model, qkv in ((ref, False), (ours, True)):
        model.train()  # the training paths (the Mamba-2 mixers ask for mamba_split_conv1d_scan_combined: None, unfused)
        out = run(model, qkv, lambda: model(x, labels=x))
        out.loss.backward()
        results.append((out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = results
    assert rel(b.logits.detach(), a.logits.detach()) < 1e-9
    assert abs(b.loss.item() - a.loss.item()) < 1e-9 * max(1.0, abs(a.loss.item()))
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        assert rel(gb[name], ga[name]) < 1e-9, name


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_within_the_torch_paths_own_error(family):
    ref, ours = pair(family, dtype=torch.float32)
    exact = H.build(family, dtype=torch.float64)
    exact.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in ref.state_dict().items()})
    x = ids(T=40)
    with torch.no_grad():
        truth = run(exact, False, lambda: exact(x).logits)
        theirs = run(ref, False, lambda: ref(x).logits)
        mine = run(ours, True, lambda: ours(x).logits)
    budget = rel(theirs, truth)
    assert rel(mine, truth) <= 2 * budget + 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_with_the_cache_token_for_token(family):
    ref, ours = pair(family)
    x = ids(B=1, T=9)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    a = run(ref, False, lambda: ref.generate(x, **kw))
    b = run(ours, True, lambda: ours.generate(x, **kw))
    assert a.shape[1] == 9 + 6 and torch.equal(a, b)


def _logits(model, x, mask=None, **kw):
    import inspect

    if mask is not None and "position_ids" in inspect.signature(model.forward).parameters:
        kw["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return model(x, attention_mask=mask, **kw).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding_equals_each_sequence_alone(family):
    _, ours = pair(family)
    long, short = ids(B=1, T=13, seed=2), ids(B=1, T=8, seed=3)
    pad = 13 - 8
    x = torch.cat([long, torch.cat([torch.zeros(1, pad, dtype=long.dtype), short], 1)])
    mask = torch.ones_like(x)
    mask[1, :pad] = 0
    with torch.no_grad():
        both = run(ours, True, lambda: _logits(ours, x, mask))
        alone = [run(ours, True, lambda s=s: _logits(ours, s)) for s in (long, short)]
    assert rel(both[0], alone[0][0]) < 1e-9
    assert rel(both[1, pad:], alone[1][0]) < 1e-9


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in NO_PACKING])
def test_packed_sequences_equal_each_sequence_alone(family):
    if STANDIN:
        pytest.skip("transformers' torch fallbacks cannot keep packed sequences apart")
    if family in PACKING_SKIPPED:
        pytest.skip(f"{family}: {PACKING_SKIPPED[family]}")
    _, ours = pair(family)
    import qkv.torch
    if family not in EAGER_WHEN_PACKED:
        ours.set_attn_implementation(qkv.torch.register_hf())   # its attention layers keep the sequences apart too
    first, second = ids(B=1, T=7, seed=4), ids(B=1, T=9, seed=5)
    x = torch.cat([first, second], 1)
    cu = torch.tensor([0, 7, 16], dtype=torch.int32)
    kw = dict(position_ids=torch.cat([torch.arange(7), torch.arange(9)])[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu,
              max_length_q=9, max_length_k=9, seq_idx=torch.tensor([[0] * 7 + [1] * 9], dtype=torch.int32))
    with torch.no_grad():
        # no cache: as a trainer packs (transformers keeps packed sequences apart in attention from
        # the restarting position_ids only where no cache is made)
        packed = run(ours, True, lambda: ours(x, use_cache=False, **kw).logits)
        alone = [run(ours, True, lambda s=s: ours(s).logits) for s in (first, second)]
    assert rel(packed[0, :7], alone[0][0]) < 1e-9
    assert rel(packed[0, 7:], alone[1][0]) < 1e-9
