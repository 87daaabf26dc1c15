"""Starting a training run from GPT-2's weights (``qkv train gpt --init-from``), as nanoGPT's ``init_from='gpt2'``.

The checkpoint (``gpt2``, ``gpt2-medium``, ... : a Hugging Face hub id, read from the local
cache first; or a folder that ``transformers``' ``save_pretrained`` wrote) is read by
:func:`qkv.models.load_gpt2`. Its architecture decides the model: ``n_layer``, ``n_head``,
``n_embd``, the biases (GPT-2 has them) and the vocabulary are the checkpoint's, and a flag
that asks for another is refused. ``block_size`` is the checkpoint's unless told; a smaller
one crops the position table to its first rows (nanoGPT's ``crop_block_size``). The MLP keeps
the checkpoint's activation (GPT-2's tanh GELU) unless ``--activation`` says otherwise
(nanoGPT's model, fine-tuning GPT-2, computes the exact GELU). Dropout, the dtype and the seed
of the dropout masks are the run's.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..errors import ShapeError
from ..io.checkpoint import CheckpointError
from .config import DTYPES, TRAIN_ACTIVATIONS, TrainConfig

ARCHITECTURE = ("n_layer", "n_head", "n_embd", "bias")


def checkpoint_folder(init_from: str) -> Path:
    """The local folder of ``init_from`` (a folder, or a hub id from the cache, downloaded where
    allowed); a CheckpointError that says how to get it otherwise."""
    from ..io.gpt_files import gpt2_folder
    from ..io.locate import HUB_ID

    try:
        return gpt2_folder(init_from)
    except CheckpointError as err:
        looks_local = not isinstance(init_from, str) or not HUB_ID.match(init_from)
        if looks_local and not Path(init_from).exists():   # ./run, ../x, /abs, a/b/c: a path, not a hub id
            raise CheckpointError(f"--init-from {init_from}: no such folder: {str(init_from)!r}") from None
        if not looks_local and not Path(init_from).exists():
            err = f"there is no folder {init_from!r} here, and {err}"
        raise CheckpointError(
            f"--init-from {init_from}: {err}. GPT-2's weights come from the Hugging Face hub: fetch them once "
            f"where the network allows (python -c \"import huggingface_hub as h; h.snapshot_download('{init_from}', "
            f"allow_patterns=['*.json', 'model.safetensors', 'merges.txt'])\"), or pass a folder that transformers' "
            f"save_pretrained wrote") from None


def init_model(cfg: TrainConfig, init_from: str, given=(), names=None):
    """``(cfg, model, folder)``: the training config made to fit the checkpoint ``init_from``
    (see the module docstring; ``given``: the fields the user set, checked against it), the
    GPT with its weights (positions cropped to ``block_size``) in training mode, and the
    checkpoint's folder (where its tokenizer may be)."""
    from ..models.gpt import GPT
    from ..io.gpt_files import load_gpt2
    from .loop import gpt_config

    show = (lambda f: f) if names is None else (lambda f: names.get(f, f))
    if cfg.layers is not None:
        raise ShapeError(f"--init-from {init_from} has softmax attention in every layer (GPT-2's); it cannot "
                         f"start a model of {show('layers')} {cfg.layers}")
    folder = checkpoint_folder(init_from)
    src = load_gpt2(folder, dtype=DTYPES[cfg.dtype])
    c = src.config
    if not c.tie_weights or c.n_inner not in (None, 4 * c.n_embd) or c.layer_norm_eps != 1e-5:
        raise CheckpointError(f"--init-from {init_from}: qkv train gpt fine-tunes GPT-2's architecture (a tied head, "
                              f"an MLP of 4 n_embd, layer_norm_epsilon 1e-5); this one has tie_weights "
                              f"{c.tie_weights}, n_inner {c.n_inner}, layer_norm_epsilon {c.layer_norm_eps}")
    arch = {name: getattr(c, name) for name in ARCHITECTURE}
    differ = [f"{show(k)} {getattr(cfg, k)} (the checkpoint has {v})" for k, v in arch.items()
              if k in given and getattr(cfg, k) != v]
    if differ:
        raise ShapeError(f"--init-from {init_from} decides the model's shape: {', '.join(differ)}")
    block = cfg.block_size if "block_size" in given else c.block_size
    if block > c.block_size:
        raise ShapeError(f"{show('block_size')} {block} is more than the {c.block_size} positions of "
                         f"--init-from {init_from} (a smaller one crops them)")
    activation = cfg.activation if "activation" in given else c.activation
    if activation not in TRAIN_ACTIVATIONS:
        raise CheckpointError(f"--init-from {init_from}: its activation {c.activation!r} is not one qkv trains")
    cfg = replace(cfg, **arch, block_size=block, activation=activation, vocab_size=c.vocab_size,
                  init_from=str(init_from))
    model = GPT(gpt_config(cfg.resolved(names), c.vocab_size))
    for name, p in model.params.items():
        w = src.params[name]
        p[...] = w[:block] if name == "transformer.wpe.weight" else w   # crop_block_size
    return cfg, model.train(), folder
