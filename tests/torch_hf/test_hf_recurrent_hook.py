"""register_hf(recurrent=True): which function a modeling module's recurrent layer calls, for modules
imported before and after the call, undone by recurrent=False and by the context; a function
qkv.torch.hf_kernels lacks keeps transformers' path and says so once. A fake qkv.torch.hf_kernels
counts the calls (the real functions are checked in test_hf_hybrid_families.py)."""
from __future__ import annotations

import importlib
import sys
import types
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import qkv.torch  # noqa: E402
from qkv.torch import hf_recurrent  # noqa: E402

QWEN = "transformers.models.qwen3_next.modeling_qwen3_next"
# modeling modules of the families that call the functions, none imported by another test file
LATE = ["transformers.models.lfm2_moe.modeling_lfm2_moe", "transformers.models.lfm3.modeling_lfm3",
        "transformers.models.inkling2.modeling_inkling2", "transformers.models.lara_mini.modeling_lara_mini"]


@pytest.fixture
def fake(monkeypatch):
    """A qkv.torch.hf_kernels with causal_conv1d_fn and chunk_gated_delta_rule only, each a counter
    that returns what transformers' torch function of the module it replaced returns."""
    module = types.ModuleType(hf_recurrent.KERNELS_MODULE)
    module.calls = []

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, activation=None):
        module.calls.append(("causal_conv1d_fn", seq_idx))
        out = torch.nn.functional.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1,
                                         groups=x.shape[1])[..., :x.shape[-1]]
        return torch.nn.functional.silu(out) if activation else out

    module.causal_conv1d_fn = causal_conv1d_fn
    monkeypatch.setitem(sys.modules, hf_recurrent.KERNELS_MODULE, module)
    monkeypatch.setattr(hf_recurrent, "_warned", set())
    yield module
    hf_recurrent.disable()


def _attr(module, name):
    return next(a for a, o in vars(module).items()
                if hf_recurrent.kernel_name(getattr(o, "__wrapped__", o)) == name)


def test_imported_before_is_served_then_put_back(fake):
    modeling = importlib.import_module(QWEN)
    attr = _attr(modeling, "causal_conv1d_fn")
    original = getattr(modeling, attr)
    with warnings.catch_warnings(record=True) as seen:   # one a function the fake lacks
        warnings.simplefilter("always")
        qkv.torch.register_hf(recurrent=True)
    assert any("no chunk_gated_delta_rule yet" in str(w.message) for w in seen)
    assert hf_recurrent.served(modeling)[attr] == "causal_conv1d_fn"
    gdn_attr = _attr(modeling, "chunk_gated_delta_rule")
    assert getattr(modeling, gdn_attr) is not None and gdn_attr not in hf_recurrent.served(modeling)
    x, w = torch.randn(2, 6, 5), torch.randn(6, 4)
    got = getattr(modeling, attr)(x, w, None, activation="silu", position_ids=None, seq_idx="s")
    assert fake.calls == [("causal_conv1d_fn", "s")]  # position_ids dropped: not in the signature
    assert torch.allclose(got, original(x, w, None, activation="silu"))
    qkv.torch.register_hf(recurrent=False)
    assert getattr(modeling, attr) is original and not hf_recurrent.served(modeling)


def test_the_warning_for_a_missing_function_comes_once(fake):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        qkv.torch.register_hf(recurrent=True)
        qkv.torch.register_hf(recurrent=False)
        qkv.torch.register_hf(recurrent=True)
    names = [str(w.message).split(" yet")[0] for w in seen if "hf_kernels has no" in str(w.message)]
    assert len(names) == len(set(names)) and any("chunk_gated_delta_rule" in n for n in names)


@pytest.mark.filterwarnings("ignore:qkv.torch.hf_kernels has no")   # the fake lacks most: said once, tested above
def test_a_model_runs_on_the_served_function(fake):
    import hf_hybrid as H

    model = H.build("LFM2")
    x = torch.randint(1, 97, (1, 5))
    with torch.no_grad():
        want = model(x).logits
        with qkv.torch.hf_recurrent_kernels():
            got = model(x).logits
        after = model(x).logits
    assert len(fake.calls) == 1 and torch.allclose(got, want, atol=1e-6)
    assert not hf_recurrent.enabled() and torch.equal(after, want)


@pytest.mark.filterwarnings("ignore:qkv.torch.hf_kernels has no")   # the fake lacks most: said once, tested above
def test_imported_after_is_served(fake, monkeypatch):
    name = next((n for n in LATE if n not in sys.modules), None)
    if name is None:   # the whole suite imported them all: import one afresh (both put back after)
        name = LATE[0]
        parent, _, child = name.rpartition(".")
        monkeypatch.delitem(sys.modules, name)
        if hasattr(sys.modules.get(parent), child):
            monkeypatch.delattr(sys.modules[parent], child)
    qkv.torch.register_hf(recurrent=True)
    modeling = importlib.import_module(name)
    assert "causal_conv1d_fn" in hf_recurrent.served(modeling).values()
    qkv.torch.register_hf(recurrent=False)
    assert not hf_recurrent.served(modeling)


def test_cuda_tensors_keep_the_original():
    seen = []
    served = hf_recurrent._serving("causal_conv1d_fn", lambda *a, **k: "qkv", lambda *a, **k: seen.append(k) or "orig")
    assert served(torch.zeros(1, 2, 3, device="meta"), seq_idx=1) == "orig" and seen == [{"seq_idx": 1}]
    assert served(torch.zeros(1, 2, 3)) == "qkv"
