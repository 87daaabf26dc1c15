"""flash-linear-attention's reference recurrences (``fla/ops/<op>/naive.py``), loaded by path.

``import fla`` needs triton (its GPU kernels); the naive files need torch and einops only,
so they are loaded as single modules from fla-core's installed folder without running the
package's ``__init__``. ``naive("gla")`` is ``fla/ops/gla/naive.py`` as a module; tests
skip with a reason when fla-core (the ``test`` extra) is not installed.
"""
from __future__ import annotations

import importlib.util
import os

import pytest


def naive(op: str):
    """The module ``fla/ops/<op>/naive.py`` (``op`` like ``"gla"`` or ``"generalized_delta_rule/dplr"``)."""
    pytest.importorskip("torch", reason="flash-linear-attention's references are torch code")
    pytest.importorskip("einops", reason="flash-linear-attention's references need einops (the test extra)")
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core (flash-linear-attention, the test extra) is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", *op.split("/"), "naive.py")
    mod_spec = importlib.util.spec_from_file_location(f"fla_naive_{op.replace('/', '_')}", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module
