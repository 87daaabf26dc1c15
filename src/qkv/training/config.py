"""The training configuration of ``qkv train gpt``: model, optimizer, schedule and data knobs, checked.

Every field has a default, so a run saved before a field existed reads back with the
behaviour it was trained with (embeddings not decayed, no gradient accumulation, trained from
scratch; and ``activation="gelu_tanh"``, the default before the exact GELU, nanoGPT's, became
it: :meth:`TrainConfig.from_dict` gives a saved config without the field the tanh form).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import numpy as np

from ..errors import ShapeError

DTYPES = {"float32": np.float32, "float64": np.float64}
TRAIN_ACTIVATIONS = ("gelu", "gelu_tanh")


@dataclass
class TrainConfig:
    """Model, optimizer and schedule of ``qkv train gpt``; the defaults are nanoGPT's CPU recipe.

    ``grad_clip = 0`` clips nothing (nanoGPT's rule). ``grad_accum``: micro-batches of
    ``batch_size`` rows whose mean gradient makes one update (nanoGPT's
    ``gradient_accumulation_steps``). ``decay_embeddings``: AdamW also decays ``wte``/``wpe``
    (nanoGPT decays every 2-D tensor; qkv's default leaves the embeddings out).
    ``init_from``: the GPT-2 the run started from (a name, folder or hub id), None from scratch.
    ``vocab_size``: the model's vocabulary (None: the tokenizer's, as runs before it was saved).
    ``layers``: each block's mixer (:mod:`qkv.models.hybrid`): None for attention in every block
    (runs saved before it existed), a pattern's name or comma-separated mixers.
    ``keep_best``: checkpoint at an evaluation only when its val loss is the best so far (nanoGPT's
    ``always_save_checkpoint=False``); False: at every evaluation (nanoGPT's default, True).
    """

    block_size: int = 64
    batch_size: int = 12
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False
    lr: float = 1e-3
    min_lr: float | None = None         # None: lr / 10
    warmup: int = 100
    lr_decay_steps: int | None = None   # None: steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    steps: int = 2000
    eval_interval: int = 250
    eval_iters: int = 20
    seed: int = 0
    dtype: str = "float32"
    activation: str = "gelu"            # nanoGPT's nn.GELU(): a default run converts to its ckpt.pt exactly
    decay_embeddings: bool = False
    grad_accum: int = 1
    init_from: str | None = None
    vocab_size: int | None = None
    layers: str | None = None
    keep_best: bool = False

    def resolved(self, names=None) -> "TrainConfig":
        """A copy with ``min_lr`` and ``lr_decay_steps`` filled in, checked (see :meth:`check`)."""
        cfg = TrainConfig(**asdict(self))
        cfg.check(names)  # before filling in: a bad --steps is named, not the lr_decay_steps it makes
        cfg.min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
        cfg.lr_decay_steps = cfg.steps if cfg.lr_decay_steps is None else cfg.lr_decay_steps
        cfg.check(names)
        return cfg

    def check(self, names=None) -> None:
        """A ShapeError for a value no run can train with: counts below their minimum, a rate or
        hyper-parameter that is not a finite number in its range (``lr = inf`` would make every
        weight NaN at the first step). ``names`` maps a field to the name shown for it (the
        command line shows its flags: ``--n-embd`` for ``n_embd``); unnamed fields show as is."""
        show = (lambda f: f) if names is None else (lambda f: names.get(f, f))
        for name, low in (("block_size", 1), ("batch_size", 1), ("n_layer", 1), ("n_head", 1), ("n_embd", 1),
                          ("eval_interval", 1), ("eval_iters", 1), ("steps", 1), ("warmup", 0), ("seed", 0),
                          ("grad_accum", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ShapeError(f"{show(name)} must be an int >= {low}; got {value!r}")
        if self.n_embd % self.n_head:
            raise ShapeError(f"{show('n_embd')} must be a multiple of {show('n_head')}; "
                             f"got {show('n_embd')} {self.n_embd}, {show('n_head')} {self.n_head}")
        for name, low, high, closed in (("lr", 0.0, math.inf, False), ("dropout", 0.0, 1.0, True),
                                        ("weight_decay", 0.0, math.inf, True), ("beta1", 0.0, 1.0, True),
                                        ("beta2", 0.0, 1.0, True), ("grad_clip", 0.0, math.inf, True)):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or not (low <= value if closed else low < value) or not value < high:
                where = f"{'[' if closed else '('}{low:g}, {high:g})"
                raise ShapeError(f"{show(name)} must be a finite number in {where}; got {value!r}")
        if self.min_lr is not None and (isinstance(self.min_lr, bool) or not isinstance(self.min_lr, (int, float))
                                        or not 0 <= self.min_lr <= self.lr):
            raise ShapeError(f"{show('min_lr')} must be a number in [0, {show('lr')}] = [0, {self.lr:g}]; "
                             f"got {self.min_lr!r}")
        for name in ("lr_decay_steps", "vocab_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ShapeError(f"{show(name)} must be an int >= 1; got {value!r}")
        if self.dtype not in DTYPES:
            raise ShapeError(f"{show('dtype')} must be one of {', '.join(DTYPES)} (training keeps its weights and "
                             f"AdamW's moments in it; float16 cannot hold AdamW's eps = 1e-8); got {self.dtype!r}")
        if self.activation not in TRAIN_ACTIVATIONS:
            raise ShapeError(f"{show('activation')} must be one of {', '.join(TRAIN_ACTIVATIONS)}; "
                             f"got {self.activation!r}")
        for name in ("bias", "decay_embeddings", "keep_best"):
            if not isinstance(getattr(self, name), bool):
                raise ShapeError(f"{show(name)} must be true or false; got {getattr(self, name)!r}")
        if self.layers is not None:
            self._check_layers(show)
        if self.init_from is not None and not isinstance(self.init_from, str):
            raise ShapeError(f"{show('init_from')} must be a name, folder or hub id; got {self.init_from!r}")

    def _check_layers(self, show) -> None:
        from ..models.hybrid import normalise, resolve

        if not isinstance(self.layers, str):
            raise ShapeError(f"{show('layers')} must be a pattern's name or comma-separated mixers; "
                             f"got {self.layers!r}")
        try:
            resolve(normalise(self.layers), self.n_layer)
        except ShapeError as err:
            raise ShapeError(str(err).replace("n_layer", show("n_layer")).replace("layers", show("layers"), 1)) from None

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """A saved config (``asdict``); fields it lacks (saved before they existed) take their defaults,
        but ``activation``, which takes the default of the runs that lacked it (``"gelu_tanh"``)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ShapeError(f"a saved training config has keys qkv does not know: {unknown}")
        return cls(**{"activation": "gelu_tanh", **d})
