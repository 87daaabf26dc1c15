"""``qkv cache-table``: KV-cache bytes per token of MHA, GQA, MQA and MLA at one width."""
from __future__ import annotations

HELP = "KV-cache bytes per token of MHA, GQA, MQA and MLA at one width"


def add_arguments(parser) -> None:
    parser.add_argument("--d-model", type=int, default=4096, help="model width (default 4096)")
    parser.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    parser.add_argument("--head-dim", type=int, default=None, help="head size (default d_model / heads)")
    parser.add_argument("--kv-heads", type=int, default=8, help="kv heads for the GQA row (default 8)")
    parser.add_argument("--latent", type=int, default=512, help="MLA latent size d_latent (default 512)")
    parser.add_argument("--rope-dim", type=int, default=64, help="MLA decoupled RoPE key size (default 64)")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32", "float64"],
                        help="element type of the cache (default float16; bfloat16 counts 2 bytes)")
    parser.add_argument("--layers", type=int, default=1, help="number of layers (default 1)")


def run(args) -> int:
    from ..nn import cache_table, format_cache_table

    dtype = "float16" if args.dtype == "bfloat16" else args.dtype
    rows = cache_table(args.d_model, args.heads, n_kv_heads=args.kv_heads, d_latent=args.latent,
                       d_rope=args.rope_dim, d_head=args.head_dim, dtype=dtype, n_layers=args.layers)
    d_head = args.head_dim or args.d_model // args.heads
    print(f"KV cache per token: d_model = {args.d_model}, {args.heads} heads of {d_head}, "
          f"{args.layers} layer(s), {args.dtype}\n")
    print(format_cache_table(rows))
    return 0
