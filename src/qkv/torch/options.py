"""The options of :func:`qkv.attention` as typed arguments of a PyTorch operator schema.

A ``torch.library`` operator takes tensors and plain typed scalars, nothing else, and
``torch.compile`` records every scalar argument as a constant of the graph. So each
keyword of :func:`qkv.attention` becomes one or more explicitly typed schema arguments:

==============  =======================================  ===================================
keyword         schema arguments                         encoded as
==============  =======================================  ===================================
mask            ``Tensor? mask``                         bool tensor, True = may attend
bias            ``Tensor? bias``                         float tensor (its gradient, where it requires one)
kv_lengths      ``Tensor? kv_lengths``                   int tensor ``(B,)``
alibi           ``Tensor? alibi``                        float slopes ``(Hq,)`` or ``(B, Hq)`` (no gradient)
q_lengths       ``Tensor? q_lengths``                    int tensor ``(B,)``
causal          ``str causal``                           ``"none"``, ``"on"``, ``"top_left"``, ``"bottom_right"``
align           ``str? align``                           ``None``, ``"top_left"``, ``"bottom_right"``
chunk           ``int? chunk``                           keys per chunk
window          ``int? window_left, int? window_right``  the parsed ``(left, right)``
softcap         ``float? softcap``                       ``None`` = off
dropout_p       ``float? dropout_p``                     ``0.0`` = off
dropout_seed    ``Tensor? dropout_seed``                 the seed mod 2**64 as a 0-d int64 tensor (where None
                                                         the forward operator draws one from torch's generator
                                                         and returns it: inside a graph)
scale           ``float? scale``                         ``None`` = ``1/sqrt(D)``
gqa             ``bool gqa``
method          ``str method``
==============  =======================================  ===================================

Each row of :data:`OPTIONS` says this for one keyword, and the rows are made from qkv's one
table of options (:data:`qkv.options.OPTIONS`) by the kind of value each holds: an array is a
``Tensor?``, an int ``int?`` and so on, causal, window and the dropout seed as above. The seed
is a tensor so that the one the forward operator draws inside a compiled graph reaches the
backward without becoming a Python int there (a data-dependent value, which
``fullgraph=True`` refuses). A new option of
:func:`qkv.attention` is a row there and needs nothing here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..errors import ShapeError, reject_unknown
from ..kernels import lookup
from ..options import (BY_NAME, OPTIONS as TABLE, names, parse_alignment, parse_chunk, parse_dropout, parse_flag,
                       parse_scale, parse_softcap, parse_window)

# keywords of qkv.attention that choose what is returned rather than what is computed
RETURNS = names("output")


@dataclass(frozen=True)
class Option:
    """One keyword of :func:`qkv.attention` and its arguments in the operator schema."""

    name: str                        # the keyword
    args: tuple                      # its typed schema arguments, e.g. ("Tensor? mask",)
    encode: Callable                 # keyword value -> tuple of operator argument values
    decode: Callable                 # tuple of operator argument values -> keyword value
    is_tensor: bool = False


def tensor(name: str) -> Option:
    """An optional tensor argument (mask, bias, lengths, slopes)."""
    return Option(name, (f"Tensor? {name}",), lambda value: (_as_tensor(name, value),),
                  lambda args: None if args[0] is None else to_numpy(args[0]), is_tensor=True)


def scalar(name: str, kind: str, check: Callable | None = None) -> Option:
    """A typed scalar argument (``"bool"``, ``"int?"``, ``"float?"``, ``"str"``) passed as is,
    after ``check(value)`` (which raises ShapeError or returns the value to pass)."""
    check = check or (lambda value: value)
    return Option(name, (f"{kind} {name}",), lambda value: (check(value),), lambda args: args[0])


def _encode_causal(value) -> tuple:
    on, _ = parse_alignment(value)  # refuses anything but False/None, True and an alignment name
    return ("none" if not on else value if isinstance(value, str) else "on",)


def _decode_causal(args):
    return {"none": False, "on": True}.get(args[0], args[0])


def _check_align(value):
    parse_alignment(False, value)
    return value


def _encode_window(value) -> tuple:
    return parse_window(value)


def _decode_window(args):
    return None if args == (None, None) else tuple(args)


def _check_scale(value):
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        value = value.item()
    return parse_scale(value)


def _check_bool(name: str):
    return lambda value: parse_flag(name, value)


def _check_method(value):
    if value != "auto":
        lookup(value)  # an unknown method lists the registered kernels
    return value


def _check_dropout_p(value):
    return parse_dropout(value, 0)[0]


def seed_value(value) -> int:
    """An int seed as the schema's int64 (0 for None): qkv takes it mod 2**64, so ``n`` and
    ``n - 2**64`` agree."""
    if value is None:
        return 0
    parse_dropout(0.5, value)  # refuses anything but an int, naming dropout_seed
    value = int(value) % 2 ** 64
    return value - 2 ** 64 if value >= 2 ** 63 else value


def _encode_seed(value) -> tuple:
    """An int seed as a 0-d int64 tensor (a tensor, the forward operator's drawn seed, as it is)."""
    if value is None or isinstance(value, torch.Tensor) and value.dtype == torch.int64 and value.dim() == 0:
        return (value,)
    return (torch.tensor(seed_value(value), dtype=torch.int64),)


def _decode_seed(args):
    return None if args[0] is None else int(args[0])


# the checks a scalar gets before it enters the schema (any other option: qkv's own, inside)
_CHECKS = {"align": _check_align, "chunk": parse_chunk, "scale": _check_scale, "gqa": _check_bool("gqa"),
           "method": _check_method, "softcap": parse_softcap, "dropout_p": _check_dropout_p}
_SCALAR = {"int": "int?", "float": "float?", "str": "str?", "bool": "bool"}


def _row(o) -> Option:
    """The schema row of one option of qkv's table, by the kind of value it holds."""
    if o.value == "array":
        return tensor(o.name)
    if o.value == "causal":
        return Option("causal", ("str causal",), _encode_causal, _decode_causal)
    if o.value == "window":
        return Option("window", ("int? window_left", "int? window_right"), _encode_window, _decode_window)
    if o.name == "dropout_seed":
        return Option("dropout_seed", ("Tensor? dropout_seed",), _encode_seed, _decode_seed, is_tensor=True)
    kind = _SCALAR[o.value]
    if kind == "str?" and o.default is not None:
        kind = "str"
    return scalar(o.name, kind, _CHECKS.get(o.name))


# one row per option of qkv's table (qkv.options.OPTIONS) that configures the computation
OPTIONS: tuple[Option, ...] = tuple(_row(o) for o in TABLE if o.kind != "output")

NAMES = tuple(opt.name for opt in OPTIONS)
SCHEMA_ARGS = ", ".join(arg for opt in OPTIONS for arg in opt.args)
# each option's default, from qkv's one table of options
DEFAULTS = {name: BY_NAME[name].default for name in NAMES}
# (row, index of its first argument) of each option, and of those that are tensors
_SLOTS = tuple((opt, sum(len(o.args) for o in OPTIONS[:i])) for i, opt in enumerate(OPTIONS))
_TENSOR_SLOTS = tuple((opt, i) for opt, i in _SLOTS if opt.is_tensor)


def accepted() -> tuple[str, ...]:
    """The options of :func:`qkv.attention` that configure the computation (not the returns)."""
    return names("mask", "problem", "kernel")


def encode(options: dict) -> tuple:
    """Keyword options (missing ones take qkv's defaults) -> the operator's option arguments.

    Options of plain values only (no tensor or array; what a model's every layer passes) are
    checked once and their encoding kept (:data:`KEPT` sets), keyed on each value and its type."""
    key = _plain_key(options)
    if key is not None and key in _encoded:
        return _encoded[key]
    out = _encode(options)
    if key is not None:
        if len(_encoded) >= KEPT:
            _encoded.clear()
        _encoded[key] = out
    return out


KEPT = 256  # encodings and decodings kept, each: a training loop's few sets, a dropout seed a call
_encoded: dict = {}
_decoded: dict = {}
_PLAIN = (type(None), bool, int, float, str)


def _plain_key(options: dict):
    """``((name, type, value), ...)`` sorted by name, or None where a value is not a plain
    scalar (nor a tuple of them): the types keep ``True`` and ``1`` apart, which compare equal."""
    key = []
    for name, value in options.items():
        if type(value) is tuple:
            if not all(type(x) in _PLAIN for x in value):
                return None
            value = tuple((type(x), x) for x in value)
        elif type(value) not in _PLAIN:
            return None
        key.append((name, type(value), value))
    return tuple(sorted(key, key=lambda item: item[0]))


def _encode(options: dict) -> tuple:
    unknown = sorted(set(options) - set(NAMES))
    unwired = [name for name in unknown if name in accepted()]
    if unwired:
        raise ShapeError(f"qkv.attention's option(s) {unwired} are not wired into qkv.torch yet: each needs "
                         "a row in qkv.torch.options.OPTIONS")
    reject_unknown("qkv.torch.attention", unknown, NAMES + RETURNS)  # torch's is_causal=, ...: qkv's names
    values = {**DEFAULTS, **options}
    out = []
    for opt in OPTIONS:
        out.extend(opt.encode(values[opt.name]))
    return tuple(out)


def decode(args: tuple) -> dict:
    """The operator's option arguments -> keyword arguments for :func:`qkv.attention`: the
    scalars' decoding is kept per set of scalars, the tensors are NumPy views each call."""
    key = tuple(_TENSOR if isinstance(a, torch.Tensor) else a for a in args)
    scalars = _decoded.get(key)
    if scalars is None:
        scalars = {opt.name: opt.decode(tuple(args[i:i + len(opt.args)]))
                   for opt, i in _SLOTS if not opt.is_tensor}
        if len(_decoded) >= KEPT:
            _decoded.clear()
        _decoded[key] = scalars
    out = dict(scalars)
    for opt, i in _TENSOR_SLOTS:
        out[opt.name] = opt.decode((args[i],))
    return out


_TENSOR = object()  # a tensor's place in decode's key


def tensors(args: tuple) -> list:
    """The option arguments that are tensors (or None), in schema order."""
    out, i = [], 0
    for opt in OPTIONS:
        if opt.is_tensor:
            out.append(args[i])
        i += len(opt.args)
    return out


def position(name: str) -> int:
    """The index of an option's first argument among the operator's option arguments."""
    for opt, i in _SLOTS:
        if opt.name == name:
            return i
    raise KeyError(name)


def option(args: tuple, name: str):
    """The decoded value of one option from the operator's option arguments (no tensors)."""
    i = 0
    for opt in OPTIONS:
        n = len(opt.args)
        if opt.name == name:
            return opt.decode(tuple(args[i:i + n]))
        i += n
    raise KeyError(name)


# --- tensors at the boundary ----------------------------------------------------------------

def check_cpu(name: str, t: torch.Tensor) -> None:
    """qkv computes on the CPU: any other device is a ShapeError naming the tensor."""
    if t.device.type != "cpu":
        raise ShapeError(f"{name} must be a CPU tensor (qkv computes in NumPy on the CPU); got a tensor "
                         f"on {t.device}. Move it with .cpu() first")


def _as_tensor(name: str, value):
    """An option value as a CPU tensor (arrays and lists are converted), or None."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(np.asarray(value))
        except (TypeError, ValueError, RuntimeError) as err:
            raise ShapeError(f"{name} must be a tensor or an array; got {type(value).__name__} ({err})") from None
    check_cpu(name, value)
    if value.requires_grad and name == "alibi":
        raise ShapeError("alibi must not require grad: qkv.torch.attention differentiates q, k, v and bias "
                         "only; pass alibi.detach()")
    return value


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor: no copy for every dtype NumPy has (strided views too);
    bfloat16, which NumPy lacks, becomes float32."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.to(torch.float32)
    return t.numpy()


def from_numpy(a: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous tensor sharing ``a``'s memory where ``a`` is contiguous and writable
    (what qkv returns always is), cast to ``dtype`` if given."""
    if not (a.flags.c_contiguous and a.flags.writeable) or min(a.strides, default=0) < 0:
        a = np.array(a, order="C", copy=True)   # (NumPy calls a reversed length-1 axis contiguous; torch refuses it)
    t = torch.from_numpy(a)
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


def empty(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor, on NumPy's allocation where NumPy has the dtype: NumPy asks
    Linux for transparent huge pages for an array of 4 MiB and more (``madvise``), torch's
    allocator only under ``THP_MEM_ALLOC_ENABLE=1``. A slab that the call writes once and drops
    pays its page faults every call: 32 MiB fresh from torch and written took 10 ms, from NumPy
    3 ms (2-core Xeon VM, huge pages on ``madvise``; a reused slab 3.4 ms)."""
    np_dtype = NUMPY_DTYPES.get(dtype)
    return torch.empty(shape, dtype=dtype) if np_dtype is None else torch.from_numpy(np.empty(shape, np_dtype))
