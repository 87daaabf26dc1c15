"""``qkv experiment scale``: the texts' measurement of why scores are divided by √d_k."""
from __future__ import annotations

import json

from ..extras import require
from .common import out_folder

HELP = "the texts' measurements (experiment scale: why divide by sqrt(d_k))"


def add_arguments(parser) -> None:
    from ..experiments.scale import DEFAULT_DK

    parser.add_argument("name", choices=["scale"], help="scale: why attention divides by sqrt(d_k)")
    parser.add_argument("--d-k", type=int, nargs="+", default=list(DEFAULT_DK), metavar="N",
                        help=f"key sizes to measure (default {' '.join(map(str, DEFAULT_DK))})")
    parser.add_argument("--keys", type=int, default=32, help="keys per softmax row (default 32)")
    parser.add_argument("--samples", type=int, default=512, help="queries per d_k (default 512)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    parser.add_argument("--out", metavar="DIR", help="write scale.json and scale.png here")


def run(args) -> int:
    from ..experiments.scale import format_table, plot, scale_experiment

    out = None
    if args.out:
        require("matplotlib", "viz")
        out = out_folder(args.out)
    rows = scale_experiment(args.d_k, n_keys=args.keys, n_samples=args.samples, seed=args.seed)
    print(format_table(rows, args.keys))
    if out is not None:
        record = {"n_keys": args.keys, "n_samples": args.samples, "seed": args.seed, "rows": rows}
        (out / "scale.json").write_text(json.dumps(record, indent=2))
        plot(rows, out / "scale.png", args.keys)
        print(f"\nwrote {out / 'scale.json'} and {out / 'scale.png'}")
    return 0
