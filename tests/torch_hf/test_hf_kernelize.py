"""qkv.torch.hf_kernelize: transformers' own hook (the kernels library's ``kernelize``) serving a
model's recurrent kernel functions from qkv's local kernel repository, on a CPU.

For every family of the harness (tests/hf_hybrid.py): the kernelized model's logits, in
inference and (``Mode.TRAINING``) its loss and every parameter gradient, are the same bits as
the same model under ``register_hf(recurrent=True)`` (the same qkv functions, reached the other
way), qkv's functions are the ones called, and a second model of the family that was not
kernelized keeps transformers' torch path.
"""
from __future__ import annotations

import importlib
import inspect

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("kernels", reason="the kernels library (a dependency of transformers) is not installed")

import hf_hybrid as H  # noqa: E402

from qkv import OptionError  # noqa: E402
from qkv.torch import hf_kernelize, hf_recurrent  # noqa: E402

FAMILIES = ["Qwen3-Next", "OLMo-Hybrid", "Kimi Linear", "Mamba-2", "Bamba", "NemotronH", "Jamba", "FalconMamba", "LFM2"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def counted(monkeypatch):
    """Counts the calls that reach qkv.torch.hf_kernels' functions."""
    kernels = importlib.import_module(hf_recurrent.KERNELS_MODULE)
    calls = []
    for name in hf_recurrent.FUNCTIONS:
        fn = getattr(kernels, name, None)
        if fn is None:
            continue

        def call(*a, _fn=fn, _name=name, **k):
            calls.append(_name)
            return _fn(*a, **k)
        call.__signature__ = inspect.signature(fn)
        monkeypatch.setattr(kernels, name, call)
    return calls


def _ids(seed=1, T=12):
    return torch.randint(1, 97, (2, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_kernelized_model_is_register_hf_bit_for_bit_and_only_that_model(family, cache, counted):
    from kernels import Mode

    ids = _ids()
    with hf_recurrent.hf_recurrent_kernels(True):
        ref = H.build(family)
        with torch.no_grad():
            want = ref(ids).logits
    assert counted, "register_hf(recurrent=True) must reach qkv's functions"
    counted.clear()
    plain = H.build(family)
    with torch.no_grad():
        torch_path = plain(ids).logits
    assert not counted
    model = hf_kernelize.kernelize(H.build(family), mode=Mode.INFERENCE)
    with torch.no_grad():
        got = model(ids).logits
    assert counted and set(counted) <= set(H.functions_used(model))
    assert torch.equal(got, want)
    assert (got - torch_path).abs().max() < 1e-4                          # and it is the model's answer
    counted.clear()
    with torch.no_grad():
        again = plain(ids).logits                                         # the other model: transformers' path
    assert not counted and torch.equal(again, torch_path)


@pytest.mark.parametrize("family", ["Qwen3-Next", "Kimi Linear", "Mamba-2"])
def test_kernelized_training_gives_register_hf_gradients(family, cache, counted):
    from kernels import Mode

    ids = _ids(seed=2)
    with hf_recurrent.hf_recurrent_kernels(True):
        ref = H.build(family).train()
        ref(ids, labels=ids).loss.backward()
    model = hf_kernelize.kernelize(H.build(family).train(), mode=Mode.TRAINING)
    counted.clear()
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert counted
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name


def test_the_repository_is_written_once_and_kernels_reads_it(cache):
    from kernels import LocalLayerRepository

    top = hf_kernelize.repository()
    files = sorted(p.name for p in (top / "build" / hf_kernelize.VARIANT).iterdir())
    assert files == ["__init__.py", "layers.py", "metadata.json"]
    stamp = (top / "build" / hf_kernelize.VARIANT / "layers.py").stat().st_mtime_ns
    assert hf_kernelize.repository() == top
    assert (top / "build" / hf_kernelize.VARIANT / "layers.py").stat().st_mtime_ns == stamp
    name = "qwen3_next__modeling_qwen3_next__torch_chunk_gated_delta_rule"
    cls = LocalLayerRepository(repo_path=top, layer_name=name).load()
    assert issubclass(cls, torch.nn.Module) and cls.__name__ == name
    fallback = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next").torch_chunk_gated_delta_rule
    assert list(inspect.signature(cls.forward).parameters) == list(inspect.signature(type(fallback).forward).parameters)


@pytest.mark.parametrize("name, says", [
    ("not_a_layer", "is named"),
    ("qwen3_next__modeling_qwen3_next__Qwen3NextRMSNorm", "not a recurrent kernel function"),
])
def test_a_layer_it_does_not_have_is_refused_by_name(name, says, cache):
    with pytest.raises(AttributeError, match=says):
        hf_kernelize.layer(name)


def test_a_mapping_with_one_name_from_two_modules_is_refused(cache):
    """A model whose layers come from two modeling modules that both define a kernel name cannot
    be mapped: the kernels library holds one layer a name."""
    a, b = H.build("Qwen3-Next"), H.build("OLMo-Hybrid")
    both = torch.nn.ModuleDict({"a": a, "b": b})
    with pytest.raises(OptionError, match="chunk_gated_delta_rule|causal_conv1d"):
        hf_kernelize.kernel_mapping(both)
