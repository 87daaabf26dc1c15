"""Quiet where the user did nothing wrong (issue 61): qkv's kernelize says in one line what it serves
instead of the kernels library's warning per unmapped layer, and the hook hands every keyword to a
function that wraps qkv's without functools.wraps."""
from __future__ import annotations

import importlib
import logging

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_hybrid as H  # noqa: E402

from qkv.torch import hf_recurrent  # noqa: E402


def test_kernelize_says_one_line_instead_of_a_warning_per_layer(tmp_path, monkeypatch, capsys, caplog):
    pytest.importorskip("kernels", reason="the kernels library (a dependency of transformers) is not installed")
    from qkv.torch import hf_kernelize

    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    model = H.build("Qwen3-Next", seed=0).eval()
    with caplog.at_level(logging.WARNING):
        hf_kernelize.kernelize(model)
    err = capsys.readouterr().err
    assert not [r for r in caplog.records if "No kernel mapping found" in r.getMessage()]
    lines = [line for line in err.splitlines() if line.startswith("qkv: kernelize")]
    assert len(lines) == 1 and "chunk_gated_delta_rule" in lines[0] and "keep their own forward" in lines[0]
    hf_kernelize.kernelize(H.build("Qwen3-Next", seed=0).eval(), quiet=True)
    assert "qkv: kernelize" not in capsys.readouterr().err


def test_a_wrapper_without_functools_wraps_gets_every_keyword(monkeypatch):
    kernels = importlib.import_module(hf_recurrent.KERNELS_MODULE)
    real, seen = kernels.chunk_gated_delta_rule, []

    def wrapper(*args, **kwargs):      # no functools.wraps: its signature is (*args, **kwargs)
        seen.append(sorted(kwargs))
        return real(*args, **kwargs)
    monkeypatch.setattr(kernels, "chunk_gated_delta_rule", wrapper)
    served = hf_recurrent._serving("chunk_gated_delta_rule", wrapper, real)
    B, T, H_, K = 1, 6, 2, 4
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H_, K, generator=g, dtype=torch.float64) for _ in range(3))
    gate = -torch.rand(B, T, H_, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, H_, generator=g, dtype=torch.float64)
    out, _ = served(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True)
    want, _ = real(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True)
    assert seen == [["beta", "g", "use_qk_l2norm_in_kernel"]] and torch.equal(out, want)
