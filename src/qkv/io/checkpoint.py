"""Reading a Hugging Face BERT-family folder: its config, and every tensor by name.

A folder holds ``config.json``, ``model.safetensors`` and ``tokenizer.json`` (and, for a
sentence-transformers model, ``modules.json``, ``sentence_bert_config.json`` and
``1_Pooling/config.json``). Where the folder is (a path, a hub id, the default model) is
:mod:`qkv.io.locate`'s business.

Nothing read from a folder is trusted: a file that is not the JSON object it should be, a
field of the wrong type or out of range, a non-finite weight, each is a
:class:`CheckpointError` naming the file and the field, never a raw TypeError or a model
that loads and gives other numbers.

Every checkpoint tensor goes through one explicit table (:func:`name_table`): checkpoint
name -> our name, the checkpoint's shape (from config.json) and whether it is transposed.
Hugging Face ``nn.Linear`` stores its weight as ``(out, in)``; qkv projects with
``x @ W`` so ours is ``(in, out)``. A tensor the table does not know, one it needs that
is absent, or one of another shape is a :class:`CheckpointError` naming it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ShapeError, fmt_shape

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
        if not isinstance(raw, dict):
            raise CheckpointError(f"{where} must hold a JSON object {{...}}; got {_json_kind(raw)}")
        model_type = _choice(raw, "model_type", "bert", tuple(FAMILIES), where)  # a BERT-family encoder
        pos = raw.get("position_embedding_type", "absolute")
        if pos != "absolute":
            raise CheckpointError(f"{where}: position_embedding_type must be 'absolute'; got {pos!r}")
        act = _choice(raw, "hidden_act", "gelu", ACTIVATIONS, where)
        fields = {}
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            if name not in raw:
                raise CheckpointError(f"{where}: missing the field {name!r}")
            fields[name] = _int_field(raw[name], name, where, 1)
        if fields["hidden_size"] % fields["num_attention_heads"]:
            raise CheckpointError(
                f"{where}: hidden_size must be a multiple of num_attention_heads; got "
                f"{fields['hidden_size']} and {fields['num_attention_heads']}")
        eps = raw.get("layer_norm_eps", 1e-12)
        if (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps)
                or not 0 < eps < 1):
            raise CheckpointError(f"{where}: layer_norm_eps must be a number in (0, 1) (1e-12 in BERT); "
                                  f"got {eps!r}")
        pad = raw.get("pad_token_id")
        pad = 0 if pad is None else _int_field(pad, "pad_token_id", where, 0)
        if pad >= fields["vocab_size"]:
            raise CheckpointError(f"{where}: pad_token_id must be a token id in [0, vocab_size) = "
                                  f"[0, {fields['vocab_size']}); got {pad}")
        cfg = cls(model_type=model_type, hidden_act=act, layer_norm_eps=float(eps), pad_token_id=pad, **fields)
        if cfg.max_position_embeddings - cfg.position_offset < 2:
            raise CheckpointError(f"{where}: max_position_embeddings = {cfg.max_position_embeddings} leaves "
                                  f"fewer than 2 positions after the first position id {cfg.position_offset} "
                                  f"(pad_token_id + 1 in a {model_type} model)")
        return cfg


def _json_kind(value) -> str:
    """How a JSON value reads in a message: ``a list``, ``null``, ``the string 'x'``."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"the string {value!r}"
    kinds = {dict: "an object", list: "a list", bool: "a boolean", int: "a number", float: "a number"}
    return f"{kinds.get(type(value), type(value).__name__)} {json.dumps(value)[:60]}"


def _int_field(value, name: str, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise CheckpointError(f"{where}: {name} must be {what}; got {value!r}")
    return value


def _choice(raw: dict, name: str, default: str, allowed: tuple, where: str) -> str:
    value = raw.get(name, default)
    if not isinstance(value, str) or value not in allowed:
        raise CheckpointError(f"{where}: {name} must be one of {sorted(allowed)}; got {value!r}")
    return value


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


MAX_JSON_BYTES = 64 << 20   # a config.json or a tokenizer's: real ones are kilobytes (a tokenizer.json megabytes)


def read_json(path: Path, kind: type = dict):
    """The JSON in ``path``, which must be a ``kind`` (an object, or a list); else a CheckpointError.
    A file past 64 MiB, or nested too deeply for the parser, is refused before it is believed."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise CheckpointError(f"cannot read {path}: {path.stat().st_size:,} bytes, more than the "
                                  f"{MAX_JSON_BYTES >> 20} MiB a config file may have")
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from None
    except RecursionError:
        raise CheckpointError(f"cannot read {path}: nested too deeply to be a config file") from None
    if not isinstance(value, kind):
        want = "a JSON object {...}" if kind is dict else "a JSON list [...]"
        raise CheckpointError(f"{path} must hold {want}; got {_json_kind(value)}")
    return value


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
        with np.errstate(over="ignore"):  # beyond float32: inf, refused just below
            x = x.astype(np.float32, copy=False)
        finite = np.isfinite(x)
        if not finite.all():
            first = tuple(int(i) for i in np.argwhere(~finite)[0])
            raise CheckpointError(f"{path}: tensor {prefix + name} holds {x.size - int(finite.sum())} "
                                  f"non-finite value(s) (NaN or inf in float32), the first at {first}: "
                                  "the model would give NaN embeddings")
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
    """The folder's sentence-transformers configuration (see :class:`SentenceConfig`).

    ``max_seq_length`` is checked against the model by :func:`qkv.models.load_bert`.
    """
    st_path = folder / "sentence_bert_config.json"
    st = read_json(st_path) if st_path.is_file() else {}
    lowercase = st.get("do_lower_case", False)
    if not isinstance(lowercase, bool):
        raise CheckpointError(f"{st_path}: do_lower_case must be true or false; got {lowercase!r}")
    max_len = st.get("max_seq_length")
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2):
        raise CheckpointError(f"{st_path}: max_seq_length must be an int >= 2 (tokens, specials included) "
                              f"or null; got {max_len!r}")
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return SentenceConfig(lowercase=lowercase, max_seq_length=max_len)
    modules = read_json(modules_path, list)
    pooling, normalize, unsupported = "mean", False, []
    for n, m in enumerate(modules):
        kind = m.get("type") if isinstance(m, dict) else None
        if not isinstance(kind, str) or not isinstance(m.get("path", ""), str):
            raise CheckpointError(f"{modules_path}: entry [{n}] must be an object with a string 'type' "
                                  f"(and 'path'), as sentence-transformers writes; got {_json_kind(m)}")
        kind = kind.rsplit(".", 1)[-1]
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


def layer_count(names, pattern: str) -> int:
    """How many layers a checkpoint's tensor names hold: 1 + the largest ``i`` of a name matching
    ``pattern`` (a regular expression with one group, the layer index), 0 if none."""
    import re

    found = [int(m.group(1)) for m in map(re.compile(pattern).match, names) if m]
    return max(found) + 1 if found else 0


def sizes_match(where, sizes: dict) -> None:
    """Check a file's claimed sizes against the tensors it holds, before a model of those sizes is
    allocated: ``sizes`` maps a size's name to ``(claimed, held, seen)``: ``held`` the size the
    tensors show (None where they show none) and ``seen`` where (``"wte (65, 128)"``). A config
    that says ``vocab_size = 200_000_000`` beside a (65, 128) embedding is refused here, not after
    24 GiB were asked for."""
    for name, (claimed, held, seen) in sizes.items():
        if held is not None and claimed != held:
            raise CheckpointError(f"{where}: {name} = {claimed!r}, but the tensors hold {held} ({seen}); "
                                  f"the file's sizes do not match its tensors")


def gpt_sizes_match(tensors: dict, claimed: dict, prefix: str, where) -> None:
    """A GPT config's claimed ``vocab_size``, ``block_size``, ``n_embd`` and ``n_layer`` (as the file
    says them, before any config object is made of them) against its tensors, named GPT-2's way
    under ``prefix`` (``wte.weight``, ``wpe.weight``, ``h.<i>.``)."""
    def dims(name):
        x = tensors.get(prefix + name)
        return None if x is None or np.ndim(x) != 2 else tuple(np.shape(x))

    wte, wpe = dims("wte.weight"), dims("wpe.weight")
    layers = layer_count(tensors, rf"^{prefix.replace('.', '[.]')}h[.](\d+)[.]")
    fits_in_memory(where, sum(int(np.size(x)) for x in tensors.values()))
    sizes_match(where, {"vocab_size": (claimed.get("vocab_size"), wte and wte[0], f"wte {wte}"),
                        "n_embd": (claimed.get("n_embd"), wte and wte[1], f"wte {wte}"),
                        "block_size": (claimed.get("block_size"), wpe and wpe[0], f"wpe {wpe}"),
                        "n_layer": (claimed.get("n_layer"), layers or None, f"h.0 to h.{layers - 1}")})


def fits_in_memory(where, numbers: int, copies: int = 2, itemsize: int = 4) -> None:
    """Refuse a model of ``numbers`` weights (float32) when this machine has not the memory for
    ``copies`` more of them (the model's arrays beside the file's, as they are converted), naming
    both figures, instead of failing at an allocation or calling the OOM killer."""
    from ..heap import available_memory

    need, have = numbers * itemsize * copies, available_memory()
    if have is not None and need > have:
        raise CheckpointError(f"{where}: a model of {numbers:,} weights needs about {need / 2**30:.1f} GiB more "
                              f"memory to load; this machine has {have / 2**30:.1f} GiB available")
