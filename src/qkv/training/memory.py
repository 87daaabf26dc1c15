"""What a training run needs in memory, estimated before anything is allocated, and the check that
refuses a run the machine cannot hold (naming the setting and the figure) instead of letting it
fail at allocation, or be killed by the kernel's OOM killer and take other processes with it.

The estimate is a lower bound (a run needs at least this much), so that no run that fits is
refused; with ``s`` bytes a number (4 for float32), ``V`` the vocabulary, ``C = n_embd``,
``L = n_layer``, ``T = block_size``, ``B = batch_size``, ``N = grad_accum``::

    weights      4 s (V C + T C + L 8 C²)     the embedding, the positions and every block's MLP
                                               (4C wide); each held as weights, gradients and
                                               AdamW's two moments (the mixers' own arrays on top)
    activations  s B T (2 V + L (4 C + 2 C))   one micro-batch's logits and their gradient, and
                                               per block at least the MLP's hidden and the residual
    batches      3 · 8 N B T                   a step's token ids (x, y, their offsets: int64)
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from ..heap import available_memory  # noqa: F401  (the figure check_fits compares with)

GB = 1e9


def training_bytes(cfg, vocab_size: int) -> dict[str, int]:
    """The lower bound of the module docstring, by part: ``{"weights", "activations", "batches"}``
    (Python ints: no overflow whatever the sizes)."""
    from .config import DTYPES

    s = np.dtype(DTYPES.get(cfg.dtype, np.float32)).itemsize
    v, c, n, t, b = int(vocab_size), int(cfg.n_embd), int(cfg.n_layer), int(cfg.block_size), int(cfg.batch_size)
    return {"weights": 4 * s * (v * c + t * c + n * 8 * c * c),
            "activations": s * b * t * (2 * v + n * 6 * c),
            "batches": 3 * 8 * int(cfg.grad_accum) * b * t}


def check_fits(cfg, vocab_size: int, names=None, available=None, vocab_from: str = "the vocabulary") -> None:
    """A ShapeError if the run of ``cfg`` with ``vocab_size`` tokens needs more memory than
    ``available`` bytes (default: :func:`available_memory`; unknown: no check), naming the
    settings of its largest part (``names`` maps a field to the name shown, as
    :meth:`TrainConfig.check` does; a field mapped to None is left unnamed) and the figures."""
    available = available_memory() if available is None else available
    if available is None:
        return
    parts = training_bytes(cfg, vocab_size)
    need = sum(parts.values())
    if need <= available:
        return
    show = (lambda f: f) if names is None else (lambda f: names.get(f, f))
    largest = max(parts, key=parts.get)
    named = lambda field, value: None if show(field) is None else f"{show(field)} {value}"  # noqa: E731
    if largest == "weights":
        c, v = cfg.n_embd, int(vocab_size)
        settings = [named("n_embd", c), named("n_layer", cfg.n_layer)]
        if v * c > cfg.n_layer * 8 * c * c:
            settings.insert(0, f"{vocab_from} of {v:,} tokens")
        what = "the weights, their gradients and AdamW's moments"
    else:
        settings = [named("batch_size", cfg.batch_size), named("block_size", cfg.block_size)]
        if largest == "batches":
            settings.append(named("grad_accum", cfg.grad_accum))
        what = "one step's activations" if largest == "activations" else "one step's token ids"
        if 2 * int(vocab_size) > cfg.n_layer * 6 * cfg.n_embd and largest == "activations":
            settings.append(f"{vocab_from} of {int(vocab_size):,} tokens")
    settings = [x for x in settings if x is not None]  # a field named None: not the user's to set
    raise ShapeError(f"{', '.join(settings)}: the run needs at least {need / GB:,.1f} GB of memory "
                     f"({what}: {parts[largest] / GB:,.1f} GB), more than the {available / GB:,.1f} GB "
                     f"available on this machine; make {' or '.join(settings)} smaller")
