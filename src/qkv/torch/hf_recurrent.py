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

**The answer is transformers' CPU path's** (the integration rule), in training and evaluation,
padded and packed, or a refusal:

- a function whose torch version returns None on a CPU, so that the layer takes its unfused
  path, answers None here too where serving it would change the model's answer (:data:`UNFUSED`:
  ``mamba_split_conv1d_scan_combined``, which the Mamba-2 mixers hand no attention mask);
- packed sequences reach a function only as the layer hands them (``cu_seq_lens_q`` is not
  renamed): where transformers' path runs with the sequences mixed, so does qkv's. Where
  transformers' CPU path refuses them, qkv keeps them apart or refuses: fla's functions take
  the boundaries as ``cu_seqlens`` alone and the layer's short convolution as ``seq_idx`` alone,
  so given ``seq_idx``, fla's function gets ``cu_seqlens`` made from it, and given ``cu_seqlens``
  without ``seq_idx`` (the convolution has already run across the boundaries) qkv refuses
  naming ``seq_idx`` (:func:`fla_packing`); in a model whose recurrence takes no packed sequences
  (``selective_scan_fn``: Zamba), a ``seq_idx`` handed to its convolution is refused.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import inspect
import re
import sys
import warnings

from ..errors import OptionError, ShapeError, fmt_shape

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
# transformers' replaceable functions whose torch version returns None on a CPU (the layer then
# takes its unfused path), where the fused function would not be handed what the unfused path
# uses: qkv answers None too, and the unfused path's functions are qkv's. name -> why
UNFUSED = {
    "mamba_split_conv1d_scan_combined": (
        "the Mamba-2 mixers (Mamba-2, Bamba, Falcon-H1, NemotronH, Zamba2, GraniteMoeHybrid) call it in training "
        "without a cache and hand it no attention_mask; their unfused path zeroes padded positions after the "
        "convolution (apply_mask_to_padding_states), so the fused function would let padding feed the state"),
}
KERNELS_MODULE = "qkv.torch.hf_kernels"
_PREFIX = "transformers.models."
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


def unfused(name: str):
    """The function served for a name of :data:`UNFUSED`: None whatever it is given, as
    transformers' CPU version answers, so the layer takes its unfused path."""
    def answer(*args, **kwargs):
        return None

    answer.__name__ = answer.__qualname__ = name
    answer.__doc__ = f"None, as transformers' CPU {name}: the layer takes its unfused path ({UNFUSED[name]})."
    return answer


def qkv_function(name: str):
    """qkv's function for transformers' ``name`` (:func:`unfused` for a name of :data:`UNFUSED`),
    or None (said once) where there is none yet."""
    if name in UNFUSED:
        return unfused(name)
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


def _on_cpu(args, kwargs, tensor) -> bool:
    """Whether the first tensor among the arguments (positional first) is on the CPU; True
    where there is none. ``tensor``: ``torch.Tensor``, bound once by :func:`_serving`."""
    for a in args:
        if isinstance(a, tensor):
            return a.is_cpu
    for a in kwargs.values():
        if isinstance(a, tensor):
            return a.is_cpu
    return True


def _serving(name: str, fn, original, blind: str | None = None):
    """The function put in a modeling module in place of ``original``: CPU tensors to ``fn``.
    ``blind``: the module's recurrence that cannot keep packed sequences apart (:func:`packing_blind`),
    for which a ``seq_idx`` handed to the module's convolution is refused.

    It runs at every call of a layer (a decoding step: one call a function a layer a token), so
    what can be known from ``fn`` alone is settled here, once: the keywords ``fn`` takes, whether
    it is fla's (packing as ``cu_seqlens``), whether seq_idx is refused. A call then adds ~2 µs
    to ``fn``'s own (one type test of the leading arguments, one set comparison of the keywords;
    4 µs where each call looked them up again: one thread, Zen 3)."""
    import torch

    tensor = torch.Tensor
    params = inspect.signature(fn).parameters   # through functools.wraps, the wrapped function's
    takes = frozenset(params)
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    fla = "cu_seqlens" in params and "seq_idx" not in params      # fla's: packed sequences as cu_seqlens alone
    refuses_seq_idx = blind is not None and name == "causal_conv1d_fn"

    def served(*args, **kwargs):
        if not _on_cpu(args, kwargs, tensor):
            return original(*args, **kwargs)
        if fla:
            kwargs = fla_packing(name, kwargs)
        if refuses_seq_idx and kwargs.get("seq_idx") is not None:
            raise OptionError(
                f"causal_conv1d_fn was handed seq_idx (packed sequences), but this model's recurrence, {blind}, "
                f"takes no seq_idx (nor does mamba_ssm's) and would run across the sequences' boundaries; "
                f"transformers' own CPU path refuses this input too. Pass the sequences as batch rows instead")
        if open_ended or kwargs.keys() <= takes:
            # a function that takes **kwargs (a wrapper without functools.wraps) gets every keyword
            return fn(*args, **kwargs)
        return fn(*args, **{k: v for k, v in kwargs.items() if k in takes})

    served.__name__ = served.__qualname__ = getattr(original, "__name__", name)
    served.__doc__ = f"transformers' {name} served by qkv.torch.hf_kernels.{name} on CPU tensors."
    served.__wrapped__ = original
    served._qkv_serves = name
    return served


def fla_packing(name: str, kwargs: dict) -> dict:
    """The keyword arguments of a call of fla's function ``name``, with the packed sequences as
    it takes them (``cu_seqlens``); or an error where the layer has already mixed them.

    transformers' layers hand fla's function ``cu_seqlens`` (Qwen3-Next's pop of
    ``cu_seq_lens_q``) or nothing, and their forward's keyword arguments besides, ``seq_idx``
    among them, by which the same layer's ``causal_conv1d_fn`` keeps the sequences apart:

    - neither: unchanged (one sequence a row, as transformers computes it);
    - ``seq_idx (1, T)``: ``cu_seqlens`` made from its runs (a given ``cu_seqlens`` or
      ``cu_seq_lens_q`` must agree);
    - ``cu_seqlens`` without ``seq_idx``: refused naming seq_idx (the convolution ran across
      the boundaries; transformers' CPU path refuses this input too).
    """
    seq_idx, given = kwargs.get("seq_idx"), kwargs.get("cu_seqlens")
    if seq_idx is None:
        if given is not None:
            raise OptionError(
                f"{name} was handed cu_seqlens (packed sequences) but the layer's call carries no seq_idx, by which "
                f"its short convolution (causal_conv1d_fn) keeps the sequences apart: it ran across their "
                f"boundaries. Pass seq_idx as well (DataCollatorWithFlattening(return_seq_idx=True)); "
                f"transformers' own CPU path refuses this input too")
        return kwargs
    cu = seq_idx_offsets(name, seq_idx)
    for other in ("cu_seqlens", "cu_seq_lens_q"):
        theirs = kwargs.get(other)
        if theirs is not None and [int(c) for c in theirs.tolist()] != cu.tolist():
            raise ShapeError(f"{name}: seq_idx and {other} must mark the same packed sequences; seq_idx's offsets "
                             f"are {cu.tolist()}, {other} is {[int(c) for c in theirs.tolist()]}")
    return {**kwargs, "cu_seqlens": cu}


def seq_idx_offsets(name: str, seq_idx):
    """``cu_seqlens (S + 1,)`` int32 of the runs of equal ids in ``seq_idx (1, T)`` (a run is a
    sequence: mamba_ssm's and causal_conv1d's rule)."""
    import torch

    if not isinstance(seq_idx, torch.Tensor) or seq_idx.dim() != 2 or seq_idx.shape[0] != 1 \
            or seq_idx.dtype.is_floating_point or seq_idx.dtype == torch.bool:
        got = (f"{seq_idx.dtype} {fmt_shape(seq_idx.shape)}" if isinstance(seq_idx, torch.Tensor)
               else type(seq_idx).__name__)
        raise ShapeError(f"{name}: seq_idx must be an integer tensor (1, T) (fla's functions take packed "
                         f"sequences along T of one batch row, as cu_seqlens); got {got}")
    ids = seq_idx[0]
    cuts = (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist()
    return torch.tensor([0, *cuts, ids.numel()] if ids.numel() else [0], dtype=torch.int32)


# the recurrences that take no packed sequences (mamba_ssm's signature has neither seq_idx nor
# cu_seqlens): in a modeling module that calls one, the convolution before it refuses seq_idx
PACKING_BLIND = ("selective_scan_fn",)


def packing_blind(module) -> str | None:
    """The name of a recurrence of :data:`PACKING_BLIND` that ``module`` calls, or None."""
    names = {kernel_name(getattr(obj, "__wrapped__", obj)) for obj in vars(module).values()}
    return next((n for n in PACKING_BLIND if n in names), None)


def patch_module(module) -> list[str]:
    """Replace each of ``module``'s replaceable recurrent kernel functions that qkv has; returns
    the package function names now served."""
    served = []
    blind = packing_blind(module)
    for attr, obj in list(vars(module).items()):
        name = kernel_name(obj)
        fn = qkv_function(name) if name is not None else None
        if fn is None:
            continue
        _replaced[(module.__name__, attr)] = obj
        setattr(module, attr, _serving(name, fn, obj, blind))
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
        # first on sys.meta_path, so consulted for every module imported for the first time while
        # the hook is on: 267 in a Bamba model's first forward (numba and qkv's kernels, imported
        # lazily), none in any later forward, backward or decoding step (no import runs there);
        # a name of no modeling module is turned away by a prefix test, ~0.2 µs
        if not fullname.startswith(_PREFIX) or not _MODELING.match(fullname):
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
