"""``qkv train lookup``: learn the texts' soft dictionary lookup with qkv.nn and Adam;
``qkv train gpt``: a character-level GPT (its options and run are in ``train_gpt.py``)."""
from __future__ import annotations

import json

from ..extras import require
from .common import out_folder
from .progress import progress_bar, check_progress

HELP = ("train with qkv.nn: the texts' soft dictionary lookup (train lookup), a character-level GPT on "
        "Shakespeare or any text (train gpt)")
LOOKUP_HELP = "learn the texts' soft dictionary lookup with qkv.nn and Adam"


def add_arguments(parser) -> None:
    import argparse

    from . import train_gpt

    sub = parser.add_subparsers(dest="task", metavar="TASK", required=True,
                                help="what to learn: lookup (the soft dictionary lookup) or gpt (a character-level GPT)")
    _lookup_arguments(sub.add_parser("lookup", help=LOOKUP_HELP, description=LOOKUP_HELP))
    train_gpt.add_arguments(sub.add_parser("gpt", help=train_gpt.HELP, description=train_gpt.DESCRIPTION,
                                           formatter_class=argparse.RawDescriptionHelpFormatter))


def run(args) -> int:
    if args.task == "gpt":
        from . import train_gpt

        return train_gpt.run(args)
    return _run_lookup(args)


def _lookup_arguments(parser) -> None:
    from ..experiments.lookup import LookupConfig

    d = LookupConfig()
    parser.add_argument("--steps", type=int, default=d.steps, help=f"training steps (default {d.steps})")
    parser.add_argument("--batch", type=int, default=d.batch, help=f"sequences per step (default {d.batch})")
    parser.add_argument("--lr", type=float, default=d.lr, help=f"peak Adam learning rate (default {d.lr})")
    parser.add_argument("--pairs", type=int, default=d.n_pairs, help=f"(key, value) pairs per sequence (default {d.n_pairs})")
    parser.add_argument("--keys", type=int, default=d.n_keys, help=f"key vocabulary (default {d.n_keys})")
    parser.add_argument("--values", type=int, default=d.n_values, help=f"value vocabulary (default {d.n_values})")
    parser.add_argument("--d-model", type=int, default=d.d_model, help=f"model width (default {d.d_model})")
    parser.add_argument("--heads", type=int, default=d.n_heads, help=f"attention heads (default {d.n_heads})")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"seed of everything random (default {d.seed})")
    parser.add_argument("--out", metavar="DIR", help="write summary.json, loss.png and attention.png here")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress (a bar on a terminal, else a line every few seconds on stderr)")


def _run_lookup(args) -> int:
    from ..experiments.lookup import LookupConfig, plot_attention, plot_loss, train_lookup

    cfg = LookupConfig(n_keys=args.keys, n_values=args.values, n_pairs=args.pairs, d_model=args.d_model,
                       n_heads=args.heads, batch=args.batch, steps=args.steps, lr=args.lr, seed=args.seed)
    cfg.check()
    if not args.no_progress:
        check_progress()
    out = None
    if args.out:
        require("matplotlib", "viz")
        out = out_folder(args.out)  # before training, not after it
    if args.no_progress:
        result = train_lookup(cfg)
    else:
        with progress_bar("lookup", cfg.steps, "loss") as update:
            result = train_lookup(cfg, progress=lambda step, loss: update(loss=loss))
    s = result["summary"]
    loss = "" if s["final_loss"] is None else f", final loss {s['final_loss']:.4f}"
    print(f"held-out accuracy {s['accuracy']:.4f} (chance {s['chance']:.4f}) after {s['steps']} steps "
          f"in {s['seconds']:.1f} s{loss}; mean weight on the query's own key {s['attention_on_key']:.3f}")
    if out is not None:
        (out / "summary.json").write_text(json.dumps(s, indent=2))
        plot_loss(result["losses"], out / "loss.png", s["chance"])
        plot_attention(result["model"], result["held_out"], out / "attention.png")
        print(f"wrote {out / 'summary.json'}, {out / 'loss.png'}, {out / 'attention.png'}")
    return 0
