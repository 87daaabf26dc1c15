"""qkv's recurrent kernel functions through transformers' own hook: the ``kernels`` library's
``kernelize``, on a CPU, for one model.

``register_hf(recurrent=True)`` (:mod:`qkv.torch.hf_recurrent`) swaps the modeling modules'
function names for every model. The ``kernels`` library instead re-points the function modules
(``Func``, an ``nn.Module`` a decorated fallback becomes) of one model, from a **kernel
repository**: a folder ``build/<variant>/`` with a ``metadata.json`` and a Python package whose
``layers`` module holds one ``nn.Module`` class a layer name. On a CPU:

- ``model.kernelize()`` and ``from_pretrained(..., use_kernels=True, kernel_config=KernelConfig(...))``
  do not serve: transformers' ``KernelConfig`` takes the devices cuda, rocm, xpu, npu, neuron,
  tpu and mps only (``ValueError: Only devices in [...] are supported, got: cpu``);
- ``kernels.kernelize(model, device="cpu", mode=...)`` under ``kernels.use_kernel_mapping`` does,
  from a local repository (``kernels.LocalLayerRepository``). :func:`kernelize` is that call with
  qkv's repository and mapping.

The repository (:func:`repository`) is written on first use under qkv's cache folder
(:func:`qkv.jit_cache.root`): a ``torch-cpu`` variant whose ``layers`` module makes its classes
on demand (:func:`layer`). ``kernels`` checks that a layer's ``forward`` has the same number and
kinds of parameters as the ``Func`` it replaces, and the fallbacks' signatures differ between
families, so a layer is named after the fallback it replaces, ``<model dir>__<modeling
module>__<attribute>`` (``qwen3_next__modeling_qwen3_next__torch_chunk_gated_delta_rule``), and
takes that fallback's signature; its ``forward`` is the function ``register_hf(recurrent=True)``
would have put there (CPU tensors to :mod:`qkv.torch.hf_kernels`, anything else to
transformers' own). The repository records no digest, so ``kernels`` logs that it cannot verify
its integrity.
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from ..errors import OptionError
from . import hf_recurrent

VARIANT = "torch-cpu"
_LAYER = re.compile(r"^(?P<dir>[A-Za-z0-9_]+?)__(?P<file>modeling_[A-Za-z0-9_]+?)__(?P<attr>[A-Za-z_][A-Za-z0-9_]*)$")
_FILES = {
    "metadata.json": json.dumps({"name": "qkv-hf-kernels", "id": "qkv-hf-kernels", "version": 1, "license": "MIT",
                                 "backend": {"type": "cpu"}, "python-depends": []}, indent=2) + "\n",
    "__init__.py": '"""qkv\'s recurrent kernel functions as a kernels-library repository (qkv.torch.hf_kernelize)."""\n'
                   "from . import layers  # noqa: F401\n",
    "layers.py": '"""Layers made on demand by qkv.torch.hf_kernelize.layer (one a replaced fallback)."""\n\n\n'
                 "def __getattr__(name):\n"
                 "    from qkv.torch.hf_kernelize import layer\n\n"
                 "    return layer(name)\n",
}


def repository() -> Path:
    """The local kernel repository's folder (written, each file atomically, where missing or stale)."""
    from .. import __version__
    from ..jit_cache import root

    top = root() / "kernels" / f"qkv-hf-{__version__}"
    build = top / "build" / VARIANT
    build.mkdir(parents=True, exist_ok=True)
    for name, text in _FILES.items():
        path = build / name
        if path.is_file() and path.read_text() == text:
            continue
        fd, tmp = tempfile.mkstemp(dir=build, prefix=f".{name}.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return top


def layer_name(module_name: str, attr: str) -> str:
    """The repository's layer for ``attr`` of the modeling module ``module_name``."""
    _, _, folder, file = module_name.split(".")
    return f"{folder}__{file}__{attr}"


def layer(name: str):
    """The ``nn.Module`` class the repository's ``layers.name`` is: the fallback's signature, and
    the function ``register_hf(recurrent=True)`` serves in its place as ``forward``."""
    import torch

    m = _LAYER.match(name)
    if m is None:
        raise AttributeError(f"qkv's kernel repository has no layer {name!r}: a layer is named "
                             f"<model dir>__<modeling module>__<attribute>")
    module = importlib.import_module(f"transformers.models.{m['dir']}.{m['file']}")
    original = getattr(module, m["attr"], None)
    kernel = hf_recurrent.kernel_name(original) if original is not None else None
    fn = hf_recurrent.qkv_function(kernel) if kernel is not None else None
    if fn is None:
        raise AttributeError(f"qkv's kernel repository has no layer {name!r}: {module.__name__}.{m['attr']} is not "
                             f"a recurrent kernel function that qkv.torch.hf_kernels serves")
    served = hf_recurrent._serving(kernel, fn, original, hf_recurrent.packing_blind(module))

    def forward(self, *args, **kwargs):
        return served(*args, **kwargs)

    forward.__signature__ = inspect.signature(type(original).forward if isinstance(original, torch.nn.Module)
                                              else original)
    forward.__doc__ = served.__doc__
    return type(name, (torch.nn.Module,), {"forward": forward, "__module__": __name__})


def kernel_mapping(model) -> dict:
    """``{kernel name: {"cpu": LocalLayerRepository}}`` for every recurrent kernel function of the
    modeling modules ``model``'s layers come from, that qkv serves (for ``kernels.use_kernel_mapping``)."""
    from kernels import LocalLayerRepository

    top = repository()
    modules = sorted({type(m).__module__ for m in model.modules()} & set(sys.modules))
    mapping, where = {}, {}
    for mod_name in modules:
        if not hf_recurrent._MODELING.match(mod_name):
            continue
        for attr, obj in vars(sys.modules[mod_name]).items():
            kernel = hf_recurrent.kernel_name(obj)
            if kernel is None or hf_recurrent.qkv_function(kernel) is None:
                continue
            if kernel in where and where[kernel] != mod_name:
                raise OptionError(f"kernel_mapping: the model's layers come from {where[kernel]} and {mod_name}, "
                                  f"which both define {kernel}; a mapping holds one layer a name")
            where[kernel] = mod_name
            mapping[kernel] = {"cpu": LocalLayerRepository(repo_path=top, layer_name=layer_name(mod_name, attr))}
    return mapping


def kernelize(model, mode=None, *, quiet: bool = False):
    """``kernels.kernelize(model, device="cpu")`` with qkv's repository: ``model``'s recurrent
    kernel functions on qkv's (this model only); ``mode`` a ``kernels.Mode``, default inference
    for a model in eval mode, training otherwise. Returns the model.

    The ``kernels`` library logs a warning for every kernelizable layer the mapping does not name
    (transformers' SiLU, RMSNorm, ... : they keep their own forward, which is what is meant here);
    those are gathered into one line on stderr that says what qkv serves and what keeps its own
    forward (``quiet``: not even that line). Other records of the library pass as they are."""
    import logging

    from kernels import Mode, kernelize as _kernelize, use_kernel_mapping

    if mode is None:
        mode = Mode.TRAINING if model.training else Mode.INFERENCE
    mapping = kernel_mapping(model)
    unmapped = UnmappedLayers()
    logger = logging.getLogger("kernels._internals.layer.layer")
    logger.addFilter(unmapped)
    try:
        with use_kernel_mapping(mapping, inherit_mapping=False):
            model = _kernelize(model, device="cpu", mode=mode)
    finally:
        logger.removeFilter(unmapped)
    if not quiet:
        served = ", ".join(sorted(mapping)) or "none (no recurrent kernel function qkv serves in this model)"
        kept = sorted(set(unmapped.names))
        rest = f"; {len(kept)} other kernelizable layer(s) keep their own forward ({', '.join(kept[:6])}" \
               f"{' ...' if len(kept) > 6 else ''}), as meant" if kept else ""
        print(f"qkv: kernelize serves {served} on qkv.torch.hf_kernels (CPU tensors){rest}", file=sys.stderr)
    return model


class UnmappedLayers:
    """A logging filter that keeps the ``kernels`` library's 'No kernel mapping found for layer'
    warnings back and remembers the layers' names."""

    PATTERN = re.compile(r"No kernel mapping found for layer `([^`]*)`")

    def __init__(self):
        self.names = []

    def filter(self, record) -> bool:
        found = self.PATTERN.search(record.getMessage())
        if found:
            self.names.append(found.group(1))
            return False
        return True


__all__ = ["kernelize", "kernel_mapping", "repository", "layer", "layer_name"]
