"""``qkv sample DIR``: text from a GPT trained by ``qkv train gpt`` (its vocabulary is in the run's config)."""
from __future__ import annotations

import sys
from pathlib import Path

from ..extras import require
from .common import UsageError

HELP = "print text sampled from a GPT that qkv train gpt wrote (sample DIR)"


def add_arguments(parser) -> None:
    parser.add_argument("dir", metavar="DIR", help="a folder written by qkv train gpt --out")
    parser.add_argument("--prompt", default="\n", help="text the sample continues (default: a newline)")
    parser.add_argument("--tokens", type=int, default=500, help="characters to generate (default 500)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="divides the logits before sampling; lower is more conservative (default 0.8)")
    parser.add_argument("--top-k", type=int, default=200,
                        help="sample among the k likeliest characters only; 0: all (default 200)")


def run(args) -> int:
    require("safetensors", "models")
    import numpy as np

    from ..models.chardata import CharTokenizer
    from ..models import load_gpt

    if args.tokens < 0:
        raise UsageError(f"--tokens must be >= 0; got {args.tokens}")
    if not 0 < args.temperature < float("inf"):
        raise UsageError(f"--temperature must be a finite number > 0; got {args.temperature}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0; got {args.top_k}")
    if not (Path(args.dir) / "config.json").is_file():
        raise UsageError(f"DIR must be a folder written by qkv train gpt; {args.dir!r} has no config.json")
    model, extra = load_gpt(args.dir)
    if not isinstance(extra, dict) or "tokenizer" not in extra:
        raise UsageError(f"{args.dir} holds a GPT without a vocabulary (not written by qkv train gpt)")
    tok = CharTokenizer.from_dict(extra["tokenizer"])
    unknown = sorted(set(args.prompt) - set(tok.chars))
    if unknown:
        raise UsageError(f"--prompt has characters outside the model's vocabulary of {tok.vocab_size}: "
                         f"{''.join(unknown)!r}")
    if not args.prompt:
        raise UsageError("--prompt must have at least one character")
    model.eval()
    idx = tok.encode(args.prompt)[None, :]  # (1, T0)
    top_k = None if args.top_k == 0 else min(args.top_k, tok.vocab_size)
    out = model.generate(idx, args.tokens, temperature=args.temperature, top_k=top_k,
                         rng=np.random.default_rng(args.seed))  # (1, T0 + tokens)
    out = np.asarray(out)[0]
    text = tok.decode(out) if len(out) == idx.shape[1] + args.tokens else args.prompt + tok.decode(out)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0
