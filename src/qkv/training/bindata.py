"""nanoGPT's data folders (``train.bin``, ``val.bin``, optional ``meta.pkl``), and a text encoded with BPE.

nanoGPT's ``prepare.py`` scripts write a folder with ``train.bin`` and ``val.bin``: token ids
as raw uint16, nothing else (``np.memmap(path, dtype=np.uint16, mode="r")`` reads them), and
for character data a ``meta.pkl``: a pickled ``{"vocab_size": V, "itos": {id: char},
"stoi": {char: id}}``. Without ``meta.pkl`` the ids are GPT-2's BPE and the vocabulary is
nanoGPT's 50,304 (GPT-2's 50,257 rounded up to a multiple of 64), as its ``train.py`` assumes.

The ``.bin`` files stay memory-mapped: a batch reads its ``B`` windows and nothing more, so
a folder of any size costs no memory up front.

``meta.pkl`` is read without running code: loading a pickle can call any function it
names, so qkv's unpickler refuses every global a pickle asks for (``find_class``) and
accepts only what plain data needs (dicts, lists, strings, numbers, none of which need one).
A ``meta.pkl`` that names anything is a CheckpointError, never executed.

A folder's fingerprint (what ``--resume`` checks) is the SHA-256 of each file's name, size,
first and last MiB (a ``.bin`` may be gigabytes), and of ``meta.pkl`` whole.
"""
from __future__ import annotations

import hashlib
import io
import pickle
from pathlib import Path

import numpy as np

from ..errors import ShapeError
from .chardata import VAL_FRACTION, CharTokenizer, TokenDataset, ids_dtype
from ..io.checkpoint import CheckpointError

BIN_FILES = ("train.bin", "val.bin")
META = "meta.pkl"
NANOGPT_VOCAB = 50304   # nanoGPT's vocabulary without meta.pkl: GPT-2's 50257 padded to a multiple of 64
PROBE = 1 << 20         # bytes of each end of a .bin in its fingerprint


class _DataOnly(pickle.Unpickler):
    """An unpickler that builds plain data only: every global a pickle names is refused."""

    def find_class(self, module, name):
        raise CheckpointError(f"meta.pkl asks for {module}.{name}: qkv reads a meta.pkl of plain data only "
                              "(dicts, strings, numbers), and runs no code from it")


def read_meta(path) -> dict:
    """nanoGPT's ``meta.pkl``, read safely (see the module docstring) and checked: ``vocab_size``
    an int, ``itos`` a dict from ids 0..V-1 to one-character strings."""
    path = Path(path)
    try:
        meta = _DataOnly(io.BytesIO(path.read_bytes())).load()
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged pickle raises many kinds
        raise CheckpointError(f"cannot read {path} as nanoGPT's meta.pkl: {type(err).__name__}: {err}") from None
    if not isinstance(meta, dict) or "vocab_size" not in meta or not isinstance(meta.get("itos"), dict):
        raise CheckpointError(f"{path} must hold {{'vocab_size': int, 'itos': {{id: char}}, 'stoi': ...}} "
                              f"as nanoGPT's prepare.py writes; got {type(meta).__name__} with keys "
                              f"{sorted(map(str, meta)) if isinstance(meta, dict) else '-'}")
    itos, v = meta["itos"], meta["vocab_size"]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise CheckpointError(f"{path}: vocab_size must be an int >= 1 (the number of characters); "
                              f"got {type(v).__name__} {v!r}"[:300])
    if len(itos) != v:  # before any list of v ids is made: v may be absurd (10**12)
        raise CheckpointError(f"{path}: itos must map the ids 0..{v - 1} (vocab_size = {v:,}) to single "
                              f"characters; it maps {len(itos):,} ids")
    if not all(type(i) is int for i in itos) or set(itos) != set(range(v)) or \
            not all(isinstance(c, str) and len(c) == 1 for c in itos.values()):
        raise CheckpointError(f"{path}: itos must map the ids 0..{v - 1} (vocab_size = {v}) to single characters")
    return meta


def meta_tokenizer(meta: dict, where) -> CharTokenizer:
    """The character tokenizer of a ``meta.pkl`` (its ``itos`` in id order, which nanoGPT sorts)."""
    chars = "".join(meta["itos"][i] for i in range(meta["vocab_size"]))
    try:
        return CharTokenizer(chars)
    except ShapeError as err:
        raise CheckpointError(f"{where}: its characters must be distinct and in sorted order, as nanoGPT's "
                              f"prepare.py makes them: {err}") from None


def check_ids(ids: np.ndarray, path, vocab_size: int, vocabulary: str, chunk: int = 1 << 24) -> None:
    """Every id of ``ids`` (a memory map: read once, ``chunk`` ids at a time) below ``vocab_size``,
    else a CheckpointError naming the file, the first id out of range and its position."""
    for start in range(0, len(ids), chunk):
        part = np.asarray(ids[start:start + chunk])
        if part.size and int(part.max()) >= vocab_size:
            at = int(np.argmax(part >= vocab_size))
            raise CheckpointError(f"{path} holds the token id {int(part[at]):,} at position {start + at:,}, outside "
                                  f"{vocabulary} of {vocab_size:,} tokens (ids 0..{vocab_size - 1:,}): a batch "
                                  f"that read it would fail; was the file written with another tokenizer?")


def bin_dataset(folder, tokenizer=None, *, saved=None) -> TokenDataset:
    """nanoGPT's data folder: ``train``/``val`` memory-mapped uint16, and its tokenizer (``meta.pkl``'s
    characters; else ``tokenizer`` if given, else a :class:`~qkv.training.bpe.NoTokenizer` of 50,304;
    ``saved``: a resumed run's own, whatever the folder holds). Every id is checked against the
    tokenizer's vocabulary once, up front (:func:`check_ids`: a pass over the files), not hours
    in, when a batch happens to read it."""
    from .bpe import NoTokenizer

    folder = Path(folder)
    missing = [n for n in BIN_FILES if not (folder / n).is_file()]
    if missing:
        raise CheckpointError(f"--data folder {folder} must hold nanoGPT's train.bin and val.bin "
                              f"(uint16 token ids); {', '.join(missing)} missing")
    splits = []
    for name in BIN_FILES:
        path = folder / name
        if path.stat().st_size % 2:
            raise CheckpointError(f"{path} has an odd number of bytes: not uint16 token ids")
        splits.append(np.memmap(path, dtype=np.uint16, mode="r") if path.stat().st_size else np.zeros(0, np.uint16))
    vocabulary = "the tokenizer's vocabulary"
    if saved is not None:
        tokenizer, vocabulary = saved, "the run's vocabulary"
    elif (folder / META).is_file():
        meta = read_meta(folder / META)
        if tokenizer is not None:
            raise ShapeError(f"{folder} has a meta.pkl (a character vocabulary of {meta['vocab_size']}): "
                             "its ids are read with it, not with --tokenizer")
        tokenizer, vocabulary = meta_tokenizer(meta, folder / META), f"{folder / META}'s vocabulary"
    elif tokenizer is None:
        tokenizer, vocabulary = NoTokenizer(NANOGPT_VOCAB), "nanoGPT's GPT-2 vocabulary (no meta.pkl)"
    for name, ids in zip(BIN_FILES, splits):
        check_ids(ids, folder / name, tokenizer.vocab_size, vocabulary)
    return TokenDataset(*splits, tokenizer)


def text_dataset(text: str, tokenizer, val_fraction: float = VAL_FRACTION) -> TokenDataset:
    """A text encoded with a (BPE) tokenizer as nanoGPT's ``shakespeare/prepare.py`` does: the
    first 90 % of the characters and the rest encoded apart, ids held compact (uint16 for GPT-2)."""
    n = int(len(text) * (1.0 - val_fraction))
    dtype = ids_dtype(tokenizer.vocab_size)
    return TokenDataset(tokenizer.encode(text[:n]).astype(dtype), tokenizer.encode(text[n:]).astype(dtype), tokenizer)


def folder_digest(folder) -> str:
    """The fingerprint of a data folder (see the module docstring)."""
    folder, h = Path(folder), hashlib.sha256()
    for name in (*BIN_FILES, META):
        path = folder / name
        if not path.is_file():
            continue
        size = path.stat().st_size
        h.update(f"{name}:{size}:".encode())
        with open(path, "rb") as f:
            if name == META or size <= 2 * PROBE:
                h.update(f.read())
            else:
                h.update(f.read(PROBE))
                f.seek(size - PROBE)
                h.update(f.read(PROBE))
    return h.hexdigest()
