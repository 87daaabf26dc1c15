"""``qkv sample DIR``: text from a GPT trained by ``qkv train gpt`` (its tokenizer is in the run's folder),
or from what ``--init-from`` accepts: ``gpt2`` (a Hugging Face hub id, the local cache first) or a
folder transformers' ``save_pretrained`` (or ``qkv convert --to hf``) wrote, read with GPT-2's
tokenizer (the folder's ``tokenizer.json`` first) or ``--tokenizer``.

As nanoGPT's ``sample.py``: ``--num-samples`` samples from one seeded stream, each followed by
a line of dashes when there are more than one; ``--prompt FILE:path`` reads the prompt from
a file; ``--temperature 0`` is greedy.
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..extras import require
from .common import UsageError

HELP = "print text sampled from a GPT: a folder qkv train gpt wrote, gpt2 (a hub id) or a GPT-2 folder (sample DIR)"
SEPARATOR = "---------------"  # nanoGPT's, after each sample


def add_arguments(parser) -> None:
    parser.add_argument("dir", metavar="DIR|NAME", help="a folder written by qkv train gpt --out, or what --init-from "
                        "takes: gpt2, gpt2-medium, ... (a Hugging Face hub id, the local cache first) or a folder "
                        "transformers' save_pretrained wrote")
    parser.add_argument("--prompt", default="\n",
                        help="text the sample continues, or FILE:path to read it from a file (default: a newline)")
    parser.add_argument("--tokens", type=int, default=500, help="tokens to generate (default 500)")
    parser.add_argument("--num-samples", type=int, default=1, metavar="N",
                        help="samples to draw, one after another from the seed's stream (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="divides the logits before sampling; lower is more conservative; 0 is greedy "
                        "(default 0.8)")
    parser.add_argument("--top-k", type=int, default=200,
                        help="sample among the k likeliest tokens only; 0: all (default 200)")
    parser.add_argument("--tokenizer", metavar="gpt2|PATH", default=None,
                        help="for a run without one (nanoGPT .bin data without meta.pkl), or a GPT-2 model: gpt2 "
                        "or a folder with tokenizer.json (or vocab.json and merges.txt)")


def _prompt(text: str) -> str:
    if not text.startswith("FILE:"):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes the terminal's encoding could not decode (surrogate escapes)
            raise UsageError("--prompt must be UTF-8 text; it holds bytes that are not (write it to a file and "
                             "pass --prompt FILE:path, or fix the terminal's encoding)") from None
        return text
    path = Path(text[len("FILE:"):]).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"--prompt FILE:{path}: cannot read it as UTF-8 text: {err}") from None


def _tokenizer(args, extra):
    from ..training.bpe import NoTokenizer, load_bpe, tokenizer_from_dict

    if not isinstance(extra, dict) or "tokenizer" not in extra:
        raise UsageError(f"{args.dir} holds a GPT without a vocabulary (not written by qkv train gpt)")
    tok = tokenizer_from_dict(extra["tokenizer"], args.dir)
    if args.tokenizer is not None:
        if not isinstance(tok, NoTokenizer):
            raise UsageError(f"--tokenizer: the run in {args.dir} has its own tokenizer")
        tok = load_bpe(args.tokenizer)
    elif isinstance(tok, NoTokenizer):
        raise UsageError(f"the run in {args.dir} has token ids but no tokenizer (nanoGPT .bin data without meta.pkl): "
                         f"name one to read them with --tokenizer gpt2 (or a folder with tokenizer.json, or "
                         f"vocab.json and merges.txt)")
    return tok


def _is_run(name: str) -> bool:
    """Whether ``name`` is a folder qkv wrote (its config.json says format qkv-gpt, or a save of one
    was interrupted), rather than a GPT-2 folder or hub id."""
    import json

    from ..models.gpt import SAVED_FORMAT
    from ..io.runsave import STAGING

    folder = Path(name)
    if (folder / STAGING).is_dir():
        return True
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8")).get("format") == SAVED_FORMAT
    except ValueError:  # a damaged config.json: load_gpt says what is wrong with it
        return True
    except (OSError, AttributeError):
        return False


def _gpt2(args):
    """A GPT-2 named as ``--init-from`` names it, and its tokenizer (``--tokenizer``, else GPT-2's,
    the model's folder first)."""
    from ..models import load_gpt2
    from ..training.bpe import load_bpe
    from ..io.checkpoint import CheckpointError
    from ..training.finetune import checkpoint_folder

    if Path(args.dir).is_dir() and not (Path(args.dir) / "config.json").is_file():
        raise UsageError(f"DIR must be a folder qkv train gpt wrote or a GPT-2 folder; {args.dir!r} has no config.json")
    try:
        folder = checkpoint_folder(args.dir)
    except CheckpointError as err:
        raise UsageError(str(err).replace(f"--init-from {args.dir}", f"DIR {args.dir!r}", 1)) from None
    model = load_gpt2(folder)
    tok = load_bpe(args.tokenizer or "gpt2", near=folder)
    if tok.vocab_size > model.config.vocab_size:
        raise UsageError(f"the tokenizer has {tok.vocab_size} tokens, more than the model's vocabulary of "
                         f"{model.config.vocab_size}: name the model's own with --tokenizer")
    return model, tok


def run(args) -> int:
    require("safetensors", "models")
    try:
        return _sample(args)
    except OSError as err:  # a name the file system refuses (too long, not a folder, no permission)
        name = err.filename if err.filename is not None else args.dir
        raise UsageError(f"cannot read {str(name)[:120]!r}: {err.strerror or err}") from None
    except RecursionError:
        raise UsageError(f"{str(args.dir)[:120]!r}: a file nested too deeply to be a model's") from None


def _sample(args) -> int:
    import numpy as np

    from ..errors import ShapeError
    from ..models import load_gpt
    from ..io.runsave import finish_save, folder_lock

    for name, low in (("tokens", 0), ("num_samples", 1), ("top_k", 0)):
        if getattr(args, name) < low:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {low}; got {getattr(args, name)}")
    if not 0 <= args.seed < 2 ** 64:
        raise UsageError(f"--seed must be an int in [0, 2**64); got {args.seed}")
    if not 0 <= args.temperature < float("inf"):
        raise UsageError(f"--temperature must be a finite number >= 0 (0: greedy); got {args.temperature}")
    if _is_run(args.dir):
        finish_save(args.dir)  # a save killed half way: completed (or discarded) first
        with folder_lock(args.dir):  # a save in progress ends before the files are read
            model, extra = load_gpt(args.dir)
            tok = _tokenizer(args, extra)
    else:
        model, tok = _gpt2(args)
    prompt = _prompt(args.prompt)
    if not prompt:
        raise UsageError("--prompt must have at least one character")
    try:
        ids = tok.encode(prompt)
    except ShapeError as err:
        raise UsageError(f"--prompt has characters outside the model's vocabulary: {err}") from None
    if len(ids) == 0:
        raise UsageError("--prompt must make at least one token")
    model.eval()
    idx = np.asarray(ids, dtype=np.int64)[None, :]  # (1, T0)
    top_k = None if args.top_k == 0 else min(args.top_k, model.config.vocab_size)
    rng = np.random.default_rng(args.seed)
    for _ in range(args.num_samples):
        out = np.asarray(model.generate(idx, args.tokens, temperature=args.temperature, top_k=top_k, rng=rng))[0]
        text = tok.decode(out)  # the prompt and its continuation, as nanoGPT prints them
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        if args.num_samples > 1:
            sys.stdout.write(SEPARATOR + "\n")
    return 0
