"""``qkv explain``: what a real pretrained model attends to, layer by layer, as pictures and text.

Runs a sentence through all-MiniLM-L6-v2 (or any BERT-family folder given with --model) on
qkv's attention, writes ``explain.html`` (the self-contained explorer of every head) and
``attention-grid.png`` (layers × heads) into --out, and prints, for one token (default
"it"), the tokens it attends to most in each layer, averaged over the heads.
"""
from __future__ import annotations

import sys
import warnings

import numpy as np

from .errors import ShapeError

DEFAULT_TEXT = "The animal didn't cross the street because it was too tired."
SPECIALS = ("[CLS]", "[SEP]", "<s>", "</s>")


def add_arguments(parser) -> None:
    parser.add_argument("text", nargs="?", default=DEFAULT_TEXT, metavar="TEXT",
                        help=f'the text to explain (default: "{DEFAULT_TEXT}")')
    parser.add_argument("--model", metavar="PATH", default=None,
                        help="a Hugging Face BERT-family folder (default: the offline all-MiniLM-L6-v2)")
    parser.add_argument("--out", metavar="DIR", default="explain-out",
                        help="where explain.html and attention-grid.png go (default: ./explain-out)")
    parser.add_argument("--token", metavar="WORD", default="it",
                        help='the token whose attention is printed per layer (default: "it")')
    parser.add_argument("--top", type=int, default=3, metavar="N", help="keys printed per layer (default 3)")


def find_token(model, tokens: list[str], word: str) -> int:
    """Position of ``word``'s first word piece in ``tokens`` (first occurrence)."""
    pieces = [t for t in model.tokenize([word])[0].tokens if t not in SPECIALS]
    if not pieces:
        raise ShapeError(f"--token must be a word; got {word!r}")
    n = len(pieces)
    for i in range(len(tokens) - n + 1):
        if tokens[i:i + n] == pieces:
            return i
    shown = " ".join(tokens[:40]) + (" ..." if len(tokens) > 40 else "")
    raise ShapeError(f"--token {word!r} (word pieces {pieces}) is not in the text's tokens: {shown}")


def top_keys(attentions: np.ndarray, tokens: list[str], i: int, n: int = 3) -> list[list[tuple[str, float]]]:
    """Per layer, the ``n`` keys query ``i`` weights most, averaged over heads, specials left out."""
    mean = attentions[:, :, i, :].mean(axis=1)  # (L, H, T) -> (L, T)
    keep = np.array([t not in SPECIALS for t in tokens])
    result = []
    for row in mean:
        order = [j for j in np.argsort(-row, kind="stable") if keep[j]][:n]
        result.append([(tokens[j], float(row[j])) for j in order])
    return result


def run(args) -> int:
    from . import viz
    from .cli import out_folder, require
    from .models import load_bert

    text = args.text
    if not isinstance(text, str) or not text.strip():
        raise ShapeError("TEXT must not be empty: give a sentence, or leave it out for the default one")
    if args.top < 1:
        raise ShapeError(f"--top must be >= 1; got {args.top}")
    require("matplotlib", "viz")
    model = load_bert(args.model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens, att = model.attentions(text)
    for w in caught:
        print(f"qkv explain: warning: {w.message}", file=sys.stderr)
    i = find_token(model, tokens, args.token)

    out = out_folder(args.out)
    name = model.path.name if args.model else "all-MiniLM-L6-v2"
    page = viz.html(att, tokens, out / "explain.html", title=f"qkv explain: {name}, {len(tokens)} tokens")
    png = viz.grid(att, tokens, out / "attention-grid.png")

    n_layers, n_heads = att.shape[:2]
    special = np.array([t in SPECIALS for t in tokens])
    print(f"{name}: {n_layers} layers × {n_heads} heads, {len(tokens)} tokens, attention by qkv")
    print(f'token "{tokens[i]}" (position {i}) attends most to, per layer (mean over heads; '
          f"[CLS]/[SEP] left out, their share in brackets):")
    for layer, keys in enumerate(top_keys(att, tokens, i, args.top)):
        share = float(att[layer, :, i][:, special].sum(axis=-1).mean())  # (H, T) -> (H,) -> ()
        listing = ", ".join(f"{tok} {w:.2f}" for tok, w in keys)
        print(f"  layer {layer}: {listing}   [{share:.2f}]")
    print(f"wrote {page} (open it in a browser) and {png}")
    return 0
