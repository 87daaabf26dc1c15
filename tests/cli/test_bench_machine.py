"""The benchmark header's facts: the vector level NumPy uses, the BLAS, the exp path."""
import os
import subprocess
import sys

import pytest

from qkv.kernels import flash
from qkv_benchmarks import machine
from qkv_benchmarks.report import header, machine_line


@pytest.mark.parametrize("on, level", [
    ({"X86_V2", "X86_V3", "X86_V4", "AVX2", "AVX512F", "AVX512_SKX"}, "AVX-512"),
    ({"X86_V2", "X86_V3", "AVX2", "AVX512F"}, "AVX2"),            # X86_V4 turned off: AVX-512 unused
    ({"AVX2", "FMA3"}, "AVX2"),                                   # NumPy 1.x names
    ({"X86_V2"}, "SSE4.2"),
    ({"NEON", "ASIMD"}, "NEON"),
    ({"ASIMD", "SVE"}, "SVE"),
    (set(), "baseline"),
])
def test_vector_level_is_the_best_numpy_path_left_on(on, level):
    names = {"X86_V2", "X86_V3", "X86_V4", "AVX2", "AVX512F", "AVX512_SKX", "FMA3", "NEON", "ASIMD", "SVE"}
    assert machine.vector_level({n: n in on for n in names}) == level


def test_npy_disable_cpu_features_is_respected():
    features = machine.numpy_cpu_features()
    if not features.get("X86_V4"):
        pytest.skip("this CPU has no AVX-512 path in NumPy to turn off")
    env = dict(os.environ, NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR")
    code = "from qkv_benchmarks import machine; print(machine.vector_level(), machine.numpy_simd()['not_found'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.startswith("AVX2 ") and "X86_V4" in out
    assert machine.vector_level() == "AVX-512"  # this process was left as it was


def test_numpy_simd_splits_the_dispatch_targets():
    simd = machine.numpy_simd({"X86_V3": True, "X86_V4": False})
    assert set(simd["found"]).isdisjoint(simd["not_found"])
    assert "X86_V4" not in simd["found"]


def test_exp_path_is_what_the_kernel_module_says(monkeypatch):
    from qkv.kernels.flash import exp2

    assert machine.exp_path() == exp2.path() in ("numba", "numpy exp2", "numpy exp")
    monkeypatch.setattr(flash, "EXP_PATH", "compiled polynomial", raising=False)
    assert machine.exp_path() == "compiled polynomial"
    monkeypatch.setattr(flash, "EXP_PATH", lambda: "numpy exp", raising=False)
    assert machine.exp_path() == "numpy exp"


def test_blas_info_names_the_kernel_and_a_pinning_environment(monkeypatch):
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    monkeypatch.delenv("OPENBLAS_L2_SIZE", raising=False)   # set on some of this project's machines
    info = machine.blas_info()
    assert info["env"] == {"OPENBLAS_CORETYPE": "Haswell"}
    monkeypatch.setenv("OPENBLAS_L2_SIZE", "512")
    assert machine.blas_info()["env"] == {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "512"}
    if "kernel" not in info:
        pytest.skip("threadpoolctl does not see NumPy's BLAS here")
    assert info["library"] and info["kernel"]


def test_header_lines_carry_the_machine():
    m = {"cpu": "Some CPU", "cores": 2, "vector": "AVX2", "numpy_simd": {"found": ["X86_V3"]},
         "npy_disable_cpu_features": "X86_V4", "exp": "numpy exp2", "torch_capability": "AVX2",
         "blas": {"env": {"OPENBLAS_CORETYPE": "Haswell"}, "library": "openblas", "version": "0.3", "kernel": "Haswell"}}
    line = machine_line(m, "2.13.0")
    for part in ("Some CPU, 2 cores", "NumPy vector level AVX2 (SIMD paths found: X86_V3, NPY_DISABLE_CPU_FEATURES=X86_V4)",
                 "BLAS openblas 0.3 kernel Haswell", "qkv exp path: numpy exp2", "torch 2.13.0 (AVX2)"):
        assert part in line
    assert "torch not in this run" in machine_line(m, None)
    lines = header({"threads": 2, "repeats": 5, "quick": False, "note": None, "torch": None, "machine": m})
    assert lines[1] == machine_line(m, None)
    assert any("OPENBLAS_CORETYPE=Haswell is set" in x for x in lines)
    assert not any(x.startswith("note: quick") for x in lines)


@pytest.mark.parametrize("name, features, expect", [
    ("haswell", "", "haswell, 256-bit"),                    # the CI's AVX2 switch: Haswell's own features
    ("haswell", "+avx2,+fma,+avx512f", "haswell, 512-bit"),  # NUMBA_CPU_NAME alone keeps the host's AVX-512
    ("skylake-avx512", "", "skylake-avx512, 512-bit"),
    ("znver3", "", "znver3, 256-bit"),
])
def test_numba_target_follows_numbas_own_settings(monkeypatch, name, features, expect):
    pytest.importorskip("numba", reason="the fast extra (numba) is not installed")
    from numba.core import config
    monkeypatch.setattr(config, "CPU_NAME", name)
    monkeypatch.setattr(config, "CPU_FEATURES", features)
    assert machine.numba_target() == expect


@pytest.mark.parametrize("cpu_avx512, mkl, noted", [(True, None, True), (True, "AVX2", False), (False, None, False)])
def test_header_says_when_torchs_mkl_keeps_avx512_under_the_avx2_switch(cpu_avx512, mkl, noted):
    m = {"cpu": "Some CPU", "cores": 2, "vector": "AVX2", "numpy_simd": {"found": ["X86_V3"]},
         "npy_disable_cpu_features": "X86_V4", "exp": "numba", "torch_capability": "AVX2",
         "blas": {"env": {}, "library": "openblas", "version": "0.3", "kernel": "Haswell"},
         "cpu_avx512": cpu_avx512, "mkl_enable_instructions": mkl}
    lines = header({"threads": 2, "repeats": 5, "quick": False, "note": None, "torch": "2.13.0", "machine": m})
    assert any("MKL_ENABLE_INSTRUCTIONS=AVX2" in x for x in lines) == noted


def test_describe_reads_the_cpu_and_mkl_switch(monkeypatch):
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    d = machine.describe(with_torch=False)
    assert d["mkl_enable_instructions"] == "AVX2"
    with open("/proc/cpuinfo") as f:
        assert d["cpu_avx512"] == ("avx512f" in f.read().split())
