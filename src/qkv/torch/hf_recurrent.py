"""``register_hf(recurrent=True)``: transformers' recurrent kernel functions served by qkv.

How transformers 5.25 wires them. Each modeling module that has a recurrent layer defines its
torch fallback under the package's name, e.g. ::

    @use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, ...): ...

The decorator picks, once, at the module's import, the package's function where ``fla``
(``mamba_ssm``, ``causal_conv1d``) imports, else the torch one; on a device the package does
not list (the CPU) it always takes the torch one and refuses ``cu_seqlens`` / ``seq_idx``. With
the ``kernels`` library installed the decorated name is an ``nn.Module`` instance that
``kernelize`` can re-point for one model. The layers call that **module-level name** at every
call (``torch_chunk_gated_delta_rule(query, key, ...)``).

So the hook replaces that name, in every ``transformers.models.*.modeling_*`` module, by a
small function that sends CPU tensors to qkv's function of the same package name
(:mod:`qkv.torch.hf_kernels`, looked up by name) with the keyword arguments its signature
names (transformers' wrapper filters them the same way), and anything else (CUDA tensors,
where fla or a hub kernel may serve) to the object it replaced. Modules imported before the
call are patched at once, modules imported after it as they are imported (a
``sys.meta_path`` finder). A name qkv.torch.hf_kernels does not have keeps transformers'
path, and a warning says so once. :func:`disable` puts every replaced name back.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import inspect
import re
import sys
import warnings

# transformers' replaceable recurrent kernel functions: the name under which the modeling code
# registers each (the package's own function name) -> the package that provides it
FUNCTIONS = {
    "chunk_gated_delta_rule": "fla",
    "fused_recurrent_gated_delta_rule": "fla",
    "chunk_kda": "fla",
    "fused_recurrent_kda": "fla",
    "mamba_chunk_scan_combined": "mamba_ssm",
    "mamba_split_conv1d_scan_combined": "mamba_ssm",
    "selective_state_update": "mamba_ssm",
    "selective_scan_fn": "mamba_ssm",
    "causal_conv1d_fn": "causal_conv1d",
    "causal_conv1d_update": "causal_conv1d",
}
KERNELS_MODULE = "qkv.torch.hf_kernels"
_MODELING = re.compile(r"^transformers\.models\.[A-Za-z0-9_]+\.modeling_[A-Za-z0-9_]+$")

_replaced: dict[tuple[str, str], object] = {}  # (module name, attribute) -> transformers' object
_warned: set[str] = set()
_finder = None


def kernel_name(obj) -> str | None:
    """The package function name under which transformers registered ``obj`` (a modeling
    module's decorated torch fallback), or None when ``obj`` is not one of :data:`FUNCTIONS`."""
    if getattr(obj, "_qkv_serves", None):
        return None
    if inspect.isclass(obj):
        return None
    name = getattr(obj, "kernel_layer_name", None)  # the kernels library's function module
    if name is None and inspect.isfunction(obj) and "func_name" in obj.__code__.co_freevars:
        # without the kernels library: transformers' own wrapper, which closes over func_name
        cell = obj.__closure__[obj.__code__.co_freevars.index("func_name")]
        name = cell.cell_contents
    return name if isinstance(name, str) and name in FUNCTIONS else None


def qkv_function(name: str):
    """qkv's function for transformers' ``name``, or None (said once) where there is none yet."""
    try:
        kernels = importlib.import_module(KERNELS_MODULE)
    except ModuleNotFoundError as e:
        if e.name != KERNELS_MODULE:
            raise
        kernels = None
    fn = getattr(kernels, name, None)
    if fn is None and name not in _warned:
        _warned.add(name)
        warnings.warn(f"qkv.torch.hf_kernels has no {name} yet: transformers' own path for it (the "
                      f"{FUNCTIONS[name]} package's, or the torch fallback on a CPU) stays in place",
                      stacklevel=3)
    return fn


def _first_device(args, kwargs):
    import torch

    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device.type
    return None


def _serving(name: str, fn, original):
    """The function put in a modeling module in place of ``original``: CPU tensors to ``fn``."""
    params = inspect.signature(fn).parameters

    def served(*args, **kwargs):
        if _first_device(args, kwargs) not in (None, "cpu"):
            return original(*args, **kwargs)
        if "cu_seqlens" in params and kwargs.get("cu_seqlens") is None and kwargs.get("cu_seq_lens_q") is not None:
            # a layer that passes its forward's **kwargs on (Kimi Linear) hands over the packing
            # as transformers' FlashAttentionKwargs name it: the same cumulative lengths
            kwargs["cu_seqlens"] = kwargs["cu_seq_lens_q"]
        return fn(*args, **{k: v for k, v in kwargs.items() if k in params})

    served.__name__ = served.__qualname__ = getattr(original, "__name__", name)
    served.__doc__ = f"transformers' {name} served by qkv.torch.hf_kernels.{name} on CPU tensors."
    served.__wrapped__ = original
    served._qkv_serves = name
    return served


def patch_module(module) -> list[str]:
    """Replace each of ``module``'s replaceable recurrent kernel functions that qkv has; returns
    the package function names now served."""
    served = []
    for attr, obj in list(vars(module).items()):
        name = kernel_name(obj)
        fn = qkv_function(name) if name is not None else None
        if fn is None:
            continue
        _replaced[(module.__name__, attr)] = obj
        setattr(module, attr, _serving(name, fn, obj))
        served.append(name)
    return served


def unpatch_module(module) -> None:
    """Put transformers' own functions back in one modeling module (the hook stays on for others)."""
    for (mod_name, attr), original in list(_replaced.items()):
        if mod_name == module.__name__:
            if getattr(getattr(module, attr, None), "__wrapped__", None) is original:
                setattr(module, attr, original)
            del _replaced[(mod_name, attr)]


class _PatchingLoader(importlib.abc.Loader):
    """A modeling module's own loader, then :func:`patch_module` on the module it made."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        if _finder is not None:
            patch_module(module)

    def __getattr__(self, attr):  # get_source, get_code, is_package, ... of the real loader
        return getattr(self.loader, attr)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds a ``transformers.models.*.modeling_*`` module as the other finders do and wraps its loader."""

    def find_spec(self, fullname, path, target=None):
        if not _MODELING.match(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def enable() -> None:
    """Serve transformers' recurrent kernel functions with qkv's, in modeling modules imported
    now and later (idempotent)."""
    global _finder
    if _finder is None:
        _finder = _Finder()
        sys.meta_path.insert(0, _finder)
    for mod_name, module in list(sys.modules.items()):
        if module is not None and _MODELING.match(mod_name):
            patch_module(module)


def disable() -> None:
    """Put transformers' own functions back everywhere and stop patching new modules."""
    global _finder
    if _finder is not None:
        sys.meta_path.remove(_finder)
        _finder = None
    for mod_name in {m for m, _ in _replaced}:
        module = sys.modules.get(mod_name)
        if module is not None:
            unpatch_module(module)
    _replaced.clear()


def enabled() -> bool:
    return _finder is not None


@contextlib.contextmanager
def hf_recurrent_kernels(on: bool = True):
    """``register_hf(recurrent=on)`` while the block runs; the previous state after it."""
    before = enabled()
    (enable if on else disable)()
    try:
        yield
    finally:
        (enable if before else disable)()


def served(module) -> dict[str, str]:
    """``{attribute: package function name}`` of the functions qkv serves in a modeling module now."""
    return {attr: obj._qkv_serves for attr, obj in vars(module).items() if getattr(obj, "_qkv_serves", None)}
