"""Where a ratio came from: the CPU's vector level as NumPy uses it, the BLAS and its kernel,
the exp path of qkv's kernel, and torch's CPU capability.

The same script runs at different speeds on an AVX-512 and an AVX2-only CPU, and NumPy,
OpenBLAS and torch can each be told to use less than the CPU has (``NPY_DISABLE_CPU_FEATURES``,
``OPENBLAS_CORETYPE``, ``ATEN_CPU_CAPABILITY``). So the bench reports what each library
runs with, read at run time, not what the CPU could do.
"""
from __future__ import annotations

import os

# NumPy's dispatch targets, best first, and the vector level each stands for. NumPy 2.4
# groups x86 features into X86_V2/V3/V4; older versions name AVX512_SKX, AVX2.
_LEVELS = (
    (("X86_V4", "AVX512_SKX"), "AVX-512"),
    (("X86_V3", "AVX2"), "AVX2"),
    (("SVE",), "SVE"),
    (("ASIMD", "NEON"), "NEON"),
    (("X86_V2", "SSE42"), "SSE4.2"),
)
_BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def _umath():
    try:
        from numpy._core import _multiarray_umath
    except ImportError:  # NumPy 1.x
        from numpy.core import _multiarray_umath
    return _multiarray_umath


def numpy_cpu_features() -> dict[str, bool]:
    """NumPy's run-time CPU features (``np.show_runtime()`` reads the same), with the ones
    turned off by ``NPY_DISABLE_CPU_FEATURES`` reported False."""
    return dict(_umath().__cpu_features__)


def numpy_simd(features: dict[str, bool] | None = None) -> dict[str, list[str]]:
    """NumPy's SIMD dispatch targets as ``np.show_runtime()`` lists them: ``baseline`` (compiled
    in), ``found`` and ``not_found`` (the optimised paths this process may or may not take)."""
    features = numpy_cpu_features() if features is None else features
    umath = _umath()
    dispatch = list(umath.__cpu_dispatch__)
    return {"baseline": list(umath.__cpu_baseline__), "found": [f for f in dispatch if features.get(f)],
            "not_found": [f for f in dispatch if not features.get(f)]}


def vector_level(features: dict[str, bool] | None = None) -> str:
    """The widest vector instruction set NumPy uses here: "AVX-512", "AVX2", "SVE", "NEON",
    "SSE4.2" or "baseline".

    >>> vector_level({"AVX2": True, "X86_V3": True, "AVX512F": True, "X86_V4": False})
    'AVX2'
    """
    features = numpy_cpu_features() if features is None else features
    for names, level in _LEVELS:
        if any(features.get(n) for n in names):
            return level
    return "baseline"


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (None where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_has_avx512() -> bool:
    """The CPU itself has AVX-512 (/proc/cpuinfo's avx512f), whatever the run-time switches say."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


def blas_info() -> dict:
    """NumPy's BLAS as threadpoolctl sees it: library, version, kernel (``architecture``),
    and the OpenBLAS settings found in the environment under ``env``."""
    info = {"env": {k: os.environ[k] for k in _BLAS_ENV if k in os.environ}}
    try:
        from threadpoolctl import threadpool_info
        blas = [x for x in threadpool_info() if x.get("user_api") == "blas"]
        if blas:
            info.update(kernel=blas[0].get("architecture"), library=blas[0].get("internal_api"),
                        version=blas[0].get("version"))
    except Exception:  # informational only
        pass
    return info


def exp_path() -> str:
    """Which exp qkv's tiled kernel runs, as the kernel module says in ``EXP_PATH`` (a string,
    or a function returning one); "numpy exp2" when it says nothing."""
    from qkv.kernels import flash
    said = getattr(flash, "EXP_PATH", None)
    if callable(said):
        said = said()
    return str(said) if said else "numpy exp2"


def numba_target() -> str | None:
    """The CPU numba compiles qkv's passes for and its widest vectors ("haswell, 256-bit"), as
    numba's own settings decide: ``NUMBA_CPU_NAME`` alone keeps the host's features (AVX-512
    code under a Haswell name); an AVX2-only CPU also takes ``NUMBA_CPU_FEATURES=`` (empty).
    None without numba."""
    try:
        import llvmlite.binding as ll
        from numba.core import config
    except Exception:  # no numba: informational only
        return None
    name = config.CPU_NAME or ll.get_host_cpu_name()
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else ll.get_host_cpu_features().flatten()
    if features:
        wide = "+avx512f" in features.split(",")
    else:  # the CPU name's own features
        wide = name.lower() not in ("haswell", "broadwell", "skylake", "znver1", "znver2", "znver3",
                                    "alderlake", "generic", "x86-64", "x86-64-v2", "x86-64-v3")
    return f"{name}, {512 if wide else 256}-bit"


def torch_capability() -> str | None:
    """The vector level torch's kernels run with ("AVX512", "AVX2", ...), if torch says."""
    try:
        import torch
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # missing torch or an old one: informational only
        return None


def describe(with_torch: bool) -> dict:
    """Everything above as one dict (the ``machine`` entry of the results)."""
    features = numpy_cpu_features()
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "vector": vector_level(features),
            "numpy_simd": numpy_simd(features),
            "npy_disable_cpu_features": os.environ.get("NPY_DISABLE_CPU_FEATURES"),
            "blas": blas_info(), "exp": exp_path(), "numba": numba_target(),
            "torch_capability": torch_capability() if with_torch else None,
            "cpu_avx512": cpu_has_avx512(), "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS")}
