"""What a GPT run trains on (``qkv train gpt --data``): a text file (by characters or BPE), nanoGPT's ``.bin`` folder, or Shakespeare.

``--data FILE`` is a UTF-8 text, encoded by characters (``--tokenizer char``, the default)
or with a BPE tokenizer (``--tokenizer gpt2|PATH``; the default with ``--init-from``);
``--data DIR`` is a folder nanoGPT's ``prepare.py`` wrote (``train.bin``, ``val.bin``,
``meta.pkl`` optional), memory-mapped. A run records which (``data["kind"]``: ``"text"`` or
``"bin"``) and a digest of it, and ``--resume`` reads it again the same way, refusing other data.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import ShapeError

SHAKESPEARE = "shakespeare"


def read_text(source: str) -> str:
    if source == SHAKESPEARE:
        from .corpus import shakespeare_text

        return shakespeare_text()
    path = Path(source)
    if not path.is_file():
        raise ShapeError(f"--data must be a text file or a folder with nanoGPT's train.bin and val.bin; "
                         f"{source!r} is neither")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ShapeError(f"--data {source!r} cannot be read as UTF-8 text: {err}") from None


def _bpe(spec: str, near, download: bool = True):
    from .bpe import load_bpe

    return load_bpe(spec, near=near, download=download)


def new_data(data: str | None, spec: str | None, vocab_size, init_folder=None):
    """``(dataset, data record)`` of a new run's ``--data`` (``data``: a text file, a nanoGPT folder,
    or None for Shakespeare) and ``--tokenizer`` (``spec``); ``vocab_size`` is the model's when it
    comes from ``--init-from`` (its folder: ``init_folder``), else None."""
    from .bindata import bin_dataset, folder_digest, text_dataset
    from .bpe import NoTokenizer
    from .chardata import CharDataset
    from .loop import text_digest

    source = str(Path(data).resolve()) if data else SHAKESPEARE
    if data and Path(data).is_dir():
        if spec == "char":
            raise ShapeError(f"--tokenizer char: the folder {data} holds token ids already (train.bin, val.bin)")
        tokenizer = None
        if spec is not None:
            tokenizer = _bpe(spec, init_folder)
        elif vocab_size is not None and not (Path(data) / "meta.pkl").is_file():
            try:  # the checkpoint's tokenizer, to sample with later; the ids are GPT-2's either way
                tokenizer = _bpe("gpt2", init_folder, download=False)
            except Exception:  # noqa: BLE001 - none to be had: train on the ids alone
                tokenizer = NoTokenizer(vocab_size)
        dataset = bin_dataset(data, tokenizer)
        return dataset, {"source": source, "sha256": folder_digest(data), "kind": "bin"}
    spec = spec or ("gpt2" if vocab_size is not None else "char")
    if spec == "char" and vocab_size is not None:
        raise ShapeError("--tokenizer char with --init-from: the checkpoint reads GPT-2's token ids; encode the "
                         "text with --tokenizer gpt2 (the default with --init-from)")
    text = read_text(source)
    dataset = CharDataset(text) if spec == "char" else text_dataset(text, _bpe(spec, init_folder))
    return dataset, {"source": source, "sha256": text_digest(text), "kind": "text"}


def resumed_data(data: str | None, run, out):
    """The dataset of a saved run, read the way it was (the run's tokenizer), after checking it is
    the same data (its digest); ``data`` (``--data``) may name where it is now."""
    from .bindata import bin_dataset, folder_digest, text_dataset
    from .chardata import CharDataset, CharTokenizer
    from .loop import text_digest

    source = str(Path(data).resolve()) if data else run.data["source"]
    kind = run.data.get("kind", "text")
    trained = (f"nanoGPT's data folder {run.data['source']} (train.bin, val.bin)" if kind == "bin"
               else f"the text file {run.data['source']}")
    if data and (Path(source).is_dir() if kind == "text" else Path(source).is_file()):
        raise ShapeError(f"--data {data} is a {'folder' if kind == 'text' else 'file'}, but the run in {out} "
                         f"was trained on {trained}: pass that {'file' if kind == 'text' else 'folder'} "
                         f"(or where it is now) with --data")
    if kind == "bin":
        if not Path(source).is_dir() or folder_digest(source) != run.data["sha256"]:
            raise ShapeError(f"the data folder {source} is not the one the run in {out} was trained on "
                             f"(its train.bin, val.bin or meta.pkl differ, or it is gone); pass the run's "
                             f"folder with --data")
        dataset = bin_dataset(source, saved=run.tokenizer)
    else:
        text = read_text(source)
        if text_digest(text) != run.data["sha256"]:
            raise ShapeError(f"the text of {source} is not the one the run in {out} was trained on "
                             f"(SHA-256 differs); pass the run's text with --data")
        tok = run.tokenizer
        dataset = CharDataset(text, tok) if isinstance(tok, CharTokenizer) else text_dataset(text, tok)
    run.data["source"] = source
    return dataset


def schedule_note(run, decay_given: bool) -> str | None:
    """What the learning-rate schedule does on a resume that extends the run (None if nothing to say)."""
    from .loop import lr_at

    c, step = run.cfg, run.step
    if decay_given:
        return (f"note: --lr-decay-steps {c.lr_decay_steps}: the cosine reaches min_lr {c.min_lr:g} at step "
                f"{c.lr_decay_steps}; step {step + 1} trains at lr {lr_at(step, c):.3g}")
    if c.steps > c.lr_decay_steps and c.steps > step:
        first = max(step, c.lr_decay_steps) + 1
        return (f"note: the run's schedule reaches min_lr {c.min_lr:g} at step {c.lr_decay_steps} "
                f"(its --lr-decay-steps), so steps {first}-{c.steps} train at min_lr (nanoGPT does the same); "
                f"to decay over the new total instead, resume with --lr-decay-steps {c.steps}")
    return None
