"""512-bit vectors in qkv's compiled passes (``qkv.kernels.flash.compiled.wide_vectors``).

LLVM's tuning for Intel's AVX-512 server cores prefers 256-bit vectors; each compiled pass asks
for 512 in its own function, so numba's loops there run as wide as on AMD's Zen 4.
"""
import importlib
import inspect
import re

import numpy as np
import pytest

numba = pytest.importorskip("numba", reason="the fast extra (numba) is not installed")

from qkv import jit  # noqa: E402

if not jit.enabled():
    pytest.skip("QKV_JIT=0: the compiled passes are off", allow_module_level=True)

compiled = pytest.importorskip("qkv.kernels.flash.compiled")
MODULES = ("qkv.kernels.flash.compiled", "qkv.kernels.rows.compiled", "qkv.kernels.rows.fused", "qkv.nn.fused",
           "qkv.models.compiled")
SCALAR = {("qkv.kernels.rows.compiled", "_max"),     # a scalar loop over the rare rows: nothing to widen
          ("qkv.kernels.rows.fused", "forward"),     # parallel loops over heads: each head's compiled
          ("qkv.kernels.rows.fused", "backward")}    # function (_forward_head, _backward_group) asks
SCALAR |= {("qkv.nn.fused", f"{name}_parts") for name in   # parallel loops over pieces: the pass
           ("gelu_forward32", "gelu_backward32", "gelu_tanh_forward32", "gelu_tanh_backward32",   # each piece
            "silu_forward32", "silu_backward32")}          # calls asks


def _host_has_avx512() -> bool:
    import llvmlite.binding as ll
    from numba.core import config
    # numba's own rule: NUMBA_CPU_FEATURES (even empty: the CPU name's own) over the host's
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else ll.get_host_cpu_features().flatten()
    return "+avx512f" in features.split(",")


def _passes(name):
    mod = importlib.import_module(name)
    for attr, obj in vars(mod).items():
        if isinstance(obj, numba.core.registry.CPUDispatcher) and obj.__module__ == name:
            if obj.targetoptions.get("inline", "never") == "never":
                yield attr, obj


@pytest.mark.parametrize("name", MODULES)
def test_every_compiled_pass_asks_for_wide_vectors(name):
    found = list(_passes(name))
    assert found, f"no compiled pass found in {name}"
    for attr, fn in found:
        if (name, attr) in SCALAR:
            continue
        body = inspect.getsource(fn.py_func)
        assert "wide_vectors()" in body, f"{name}.{attr} does not call wide_vectors()"


def _fresh(wide: bool):
    pow2, fastmath, wide_vectors = compiled.pow2, compiled.FASTMATH, compiled.wide_vectors
    if wide:
        @numba.njit(fastmath=fastmath)
        def f(x):
            wide_vectors()
            for j in range(x.shape[0]):
                x[j] = pow2(x[j])
    else:
        @numba.njit(fastmath=fastmath)
        def f(x):
            for j in range(x.shape[0]):
                x[j] = pow2(x[j])
    return f


def test_wide_pass_gives_the_narrow_pass_values():
    x = np.random.default_rng(0).uniform(-126, 126, 1003).astype(np.float32)
    a, b = x.copy(), x.copy()
    _fresh(True)(a)
    _fresh(False)(b)
    np.testing.assert_array_equal(a, b)   # element-wise: no reduction, so the same bits
    np.testing.assert_allclose(a, np.exp2(x.astype(np.float64)), rtol=3e-7, atol=0)


@pytest.mark.skipif(not _host_has_avx512(), reason="this CPU (as numba sees it) has no AVX-512")
def test_wide_pass_uses_512_bit_registers_on_avx512():
    f = _fresh(True)
    f(np.ones(64, np.float32))
    asm = f.inspect_asm(f.signatures[0])
    assert re.search(r"\bzmm\d", asm), "no 512-bit register in the compiled loop"
