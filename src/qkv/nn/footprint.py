"""What a KV cache costs per token: MHA, GQA, MQA and MLA side by side (``qkv cache-table``).

What a layer stores per token is the figure of merit of the attention variants:

========  ======================================  =============================
variant   stored per token and layer              elements (d_head = D)
========  ======================================  =============================
MHA       k and v of every head                   2 · H · D
GQA       k and v of each of Hkv < H kv heads     2 · Hkv · D
MQA       one shared k and v                      2 · D
MLA       the latent c_KV and the RoPE key k_R    d_latent + d_rope
========  ======================================  =============================

(DeepSeek-V2: H = 128, D = 128, d_latent = 512, d_rope = 64: MLA stores 576 elements a
token where MHA would store 32768, 1.8 %: ``qkv cache-table --d-model 5120 --heads 128
--head-dim 128``.) The layers' own ``cache_bytes_per_token()`` and the caches'
``bytes_per_token`` (:mod:`qkv.nn.cache`) agree with these numbers.
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, positive_int
from .checks import head_width, kv_heads


def cache_elements_per_token(kind: str, *, n_heads: int, d_head: int, n_kv_heads: int | None = None,
                             d_latent: int | None = None, d_rope: int = 0) -> int:
    """Numbers stored per token per layer by ``kind`` in ``("MHA", "GQA", "MQA", "MLA")``."""
    kind = kind.upper()
    if kind == "MHA":
        return 2 * n_heads * d_head
    if kind == "GQA":
        if n_kv_heads is None:
            raise ShapeError("GQA needs n_kv_heads")
        return 2 * n_kv_heads * d_head
    if kind == "MQA":
        return 2 * d_head
    if kind == "MLA":
        if d_latent is None:
            raise ShapeError("MLA needs d_latent")
        return d_latent + d_rope
    raise ShapeError(f"kind must be one of 'MHA', 'GQA', 'MQA', 'MLA'; got {kind!r}")


def cache_table(d_model: int = 4096, n_heads: int = 32, *, n_kv_heads: int = 8, d_latent: int = 512,
                d_rope: int = 64, d_head: int | None = None, dtype="float16", n_layers: int = 1) -> list[dict]:
    """KV-cache cost per token of MHA, GQA, MQA and MLA at the same model width.

    ``d_head`` (default ``d_model // n_heads``) is the same for all four. Returns rows ``{"variant", "stores",
    "elements", "bytes", "vs_mha"}``; ``bytes`` is per token for ``n_layers`` layers in
    ``dtype``. The defaults are a Llama-like width (4096, 32 heads of 128; GQA with 8 kv
    heads) and DeepSeek-V2's latent (512) and RoPE key (64).
    """
    d_model, n_heads = positive_int("d_model", d_model), positive_int("n_heads", n_heads)
    d_head = head_width(d_model, n_heads, d_head)  # the layers' rule: d_model // n_heads by default
    n_kv_heads = kv_heads(n_heads, n_kv_heads)
    d_latent, d_rope = positive_int("d_latent", d_latent), positive_int("d_rope", d_rope, 0)
    n_layers = positive_int("n_layers", n_layers)
    itemsize = np.dtype(dtype).itemsize
    variants = [
        ("MHA", f"k, v: 2 x {n_heads} heads x {d_head}", {}),
        ("GQA", f"k, v: 2 x {n_kv_heads} kv heads x {d_head}", {"n_kv_heads": n_kv_heads}),
        ("MQA", f"k, v: 2 x 1 kv head x {d_head}", {}),
        ("MLA", f"latent {d_latent} + rope key {d_rope}", {"d_latent": d_latent, "d_rope": d_rope}),
    ]
    rows, mha = [], None
    for name, stores, extra in variants:
        n = cache_elements_per_token(name, n_heads=n_heads, d_head=d_head, **extra)
        mha = n if mha is None else mha
        rows.append({"variant": name, "stores": stores, "elements": n,
                     "bytes": n * itemsize * n_layers, "vs_mha": n / mha})
    return rows


def format_cache_table(rows: list[dict]) -> str:
    """The rows of :func:`cache_table` as a Markdown table."""
    lines = ["| variant | stores per token and layer | elements | bytes/token | vs MHA |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['stores']} | {r['elements']} | {r['bytes']} | {100 * r['vs_mha']:.1f} % |")
    return "\n".join(lines)
