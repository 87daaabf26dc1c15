"""Byte-pair-encoding tokenizers (GPT-2's) through the ``tokenizers`` library, and the tokenizer of a saved run.

A BPE tokenizer is read from a ``tokenizer.json`` (the ``tokenizers`` format, as Hugging
Face saves it) or from GPT-2's original pair ``vocab.json`` + ``merges.txt`` (byte-level BPE:
GPT-2's pre-tokenizer and decoder). ``"gpt2"`` names GPT-2's own: taken from a folder given
to look in first (``qkv train gpt --init-from``'s), else from the Hugging Face cache
(``gpt2`` there), downloaded only where the network allows. Nothing is shipped with qkv.

A run records its tokenizer in its ``config.json`` (``extra.tokenizer``):
``{"kind": "char", "chars": ...}`` (:class:`~qkv.training.chardata.CharTokenizer`),
``{"kind": "bpe", "name": ..., "file": "tokenizer.json"}`` (the file saved beside it) or
``{"kind": "none", "vocab_size": V}`` (nanoGPT ``.bin`` data without a ``meta.pkl``: token
ids only; ``qkv sample --tokenizer`` names one to decode with).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import ShapeError
from .chardata import CharTokenizer
from ..io.checkpoint import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
GPT2_HUB_ID = "gpt2"
GPT2_FILES = ["tokenizer.json", "vocab.json", "merges.txt"]


class BPETokenizer:
    """A ``tokenizers.Tokenizer`` with the interface of :class:`CharTokenizer`: ``encode(text) ->
    int64 ids``, ``decode(ids) -> str``, ``vocab_size`` (added tokens included), ``to_dict()``."""

    def __init__(self, tokenizer, name: str):
        self.tokenizer, self.name = tokenizer, name
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0):
            raise ShapeError(f"ids must be ints >= 0; got {ids.dtype} from {ids.min()}")
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=False)

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    def to_dict(self) -> dict:
        return {"kind": "bpe", "name": self.name, "file": TOKENIZER_FILE}


class NoTokenizer:
    """Token ids without a vocabulary to read them by (nanoGPT ``.bin`` data without ``meta.pkl``)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)

    def _refuse(self, *_):
        raise ShapeError("this run has token ids but no tokenizer (nanoGPT .bin data without meta.pkl): "
                         "name one to read them, e.g. qkv sample DIR --tokenizer gpt2 (or a folder with "
                         "tokenizer.json, or vocab.json and merges.txt)")

    encode = decode = _refuse

    def to_dict(self) -> dict:
        return {"kind": "none", "vocab_size": self.vocab_size}


def _tokenizers():
    from ..extras import require

    return require("tokenizers", "models")


def _from_folder(folder: Path, name: str) -> BPETokenizer | None:
    """The BPE tokenizer in ``folder`` (tokenizer.json, else vocab.json + merges.txt), or None."""
    tk = _tokenizers()
    try:
        if (folder / TOKENIZER_FILE).is_file():
            return BPETokenizer(tk.Tokenizer.from_file(str(folder / TOKENIZER_FILE)), name)
        if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            model = tk.models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt"))
            tok = tk.Tokenizer(model)
            tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = tk.decoders.ByteLevel()
            return BPETokenizer(tok, name)
    except Exception as err:  # tokenizers raises its own error types
        raise CheckpointError(f"cannot read the tokenizer in {folder}: {err}") from None
    return None


def _gpt2_from_hub(download: bool = True) -> Path | None:
    """The cached (or, where allowed, downloaded) folder of GPT-2's tokenizer files, or None."""
    from ..io.locate import hub_cache, hub_offline

    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    for local in (True, False):
        if not local and (hub_offline() or not download):
            return None
        try:
            return Path(snapshot_download(GPT2_HUB_ID, cache_dir=str(hub_cache()), allow_patterns=GPT2_FILES,
                                          local_files_only=local))
        except Exception:  # noqa: BLE001 - not cached, no network, ...
            continue
    return None


def load_bpe(spec, near=None, *, download: bool = True) -> BPETokenizer:
    """The BPE tokenizer ``spec`` names: ``"gpt2"`` (GPT-2's: in the folder ``near`` first, then
    the Hugging Face cache or hub), a folder holding ``tokenizer.json`` (or ``vocab.json`` and
    ``merges.txt``), or a ``tokenizer.json`` file (``download=False``: the cache only, never the
    network). Anything else is a CheckpointError that says
    where it looked and how to get the files."""
    if not isinstance(spec, (str, os.PathLike)):
        raise ShapeError(f"the tokenizer must be 'gpt2' or a path; got {type(spec).__name__}")
    path = Path(spec).expanduser()
    if path.is_file():
        try:
            return BPETokenizer(_tokenizers().Tokenizer.from_file(str(path)), path.name)
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(f"cannot read the tokenizer {path}: {err}") from None
    if path.is_dir():
        found = _from_folder(path, str(spec))
        if found is None:
            raise CheckpointError(f"{path} holds no tokenizer: it needs tokenizer.json, or vocab.json and merges.txt")
        return found
    if spec != "gpt2":
        raise CheckpointError(f"the tokenizer {str(spec)!r} is neither 'gpt2' nor a file or folder")
    if near is not None and Path(near).is_dir():
        found = _from_folder(Path(near), "gpt2")
        if found is not None:
            return found
    folder = _gpt2_from_hub(download)
    found = None if folder is None else _from_folder(folder, "gpt2")
    if found is None:
        where = f"{near}, " if near is not None else ""
        raise CheckpointError(
            f"GPT-2's tokenizer files are not here (looked in {where}the Hugging Face cache for {GPT2_HUB_ID!r}, "
            f"and downloads are off or failed): get them once where the network allows, e.g. python -c \"import "
            f"huggingface_hub as h; h.snapshot_download('gpt2', allow_patterns={GPT2_FILES})\", or pass a folder "
            f"holding tokenizer.json (or vocab.json and merges.txt) as --tokenizer PATH")
    return found


def char_tokenizer_json(chars: str) -> str:
    """A character vocabulary (id ``i`` is ``chars[i]``) as a ``tokenizer.json`` that the
    ``tokenizers`` library, transformers' ``AutoTokenizer`` and :func:`load_bpe` read: a BPE model
    whose vocabulary is the characters and which has no merges (so each character is one token),
    no pre-tokenizer or normalizer, and a decoder that joins the tokens as they are."""
    tk = _tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tokenizer.decoder = tk.decoders.Fuse()
    return tokenizer.to_str()


def tokenizer_from_dict(d, folder=None):
    """The tokenizer a run's ``extra.tokenizer`` records (see the module docstring); a BPE one is
    read from its file in ``folder``."""
    kind = d.get("kind") if isinstance(d, dict) else None
    if kind == "char":
        return CharTokenizer.from_dict(d)
    if kind == "none" and isinstance(d.get("vocab_size"), int) and d["vocab_size"] >= 1:
        return NoTokenizer(d["vocab_size"])
    if kind == "bpe" and folder is not None:
        path = Path(folder) / str(d.get("file", TOKENIZER_FILE))
        if not path.is_file():
            raise CheckpointError(f"{folder}: the run's tokenizer file {path.name} is missing")
        tok = load_bpe(path)
        tok.name = str(d.get("name", tok.name))
        return tok
    raise CheckpointError(f"a run's tokenizer is stored as {{'kind': 'char'|'bpe'|'none', ...}}; got {d!r}"[:200])
