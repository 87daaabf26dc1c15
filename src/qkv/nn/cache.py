"""KV caches for decoding, and what they cost per token (``qkv cache-table``).

Generating text one token at a time, a causal layer would recompute every earlier key and
value at each step. A cache keeps them: a prefill of the prompt writes its T keys, then
each new token appends one and attends to everything stored, with the newest query
aligned to the newest key (``causal="bottom_right"``). What a layer stores per token is
the figure of merit of the attention variants:

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
--head-dim 128``.)
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, fmt_shape, positive_int


class Cache:
    """Preallocated per-token arrays, each ``(B, ..., max_len, F)`` (time on axis -2).

    ``length`` tokens are filled. A layer calls :meth:`write` to put new tokens after
    them (the returned views cover all ``length + T`` tokens) and :meth:`advance` once the
    step succeeded, so a failed call leaves the cache as it was. Writing past ``max_len``
    raises :class:`~qkv.ShapeError`: a full cache is never silently overwritten.
    """

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays
        first = next(iter(arrays.values()))
        self.batch, self.max_len = first.shape[0], first.shape[-2]
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache (allocated for all ``max_len`` tokens)."""
        return int(sum(a.nbytes for a in self.arrays.values()))

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one sequence costs: ``nbytes / (B * max_len)``."""
        return self.nbytes // (self.batch * self.max_len)

    def __getitem__(self, name: str) -> np.ndarray:
        """The filled part ``(B, ..., length, F)`` of array ``name``."""
        return self.arrays[name][..., : self.length, :]

    def write(self, **new: np.ndarray) -> dict[str, np.ndarray]:
        """Store ``new[name] (B, ..., T, F)`` at positions ``length .. length+T-1``.

        Returns views of every array over positions ``0 .. length+T-1``. Does not move
        ``length``; call :meth:`advance` (T) when the step is done.
        """
        if set(new) != set(self.arrays):
            raise ShapeError(f"cache.write needs arrays {sorted(self.arrays)}; got {sorted(new)}")
        t = None
        for name, x in new.items():
            store = self.arrays[name]
            want = store.shape[:-2] + (x.shape[-2],) + store.shape[-1:]
            if x.shape != want or (t is not None and x.shape[-2] != t):
                lead = ", ".join(str(n) for n in store.shape[:-2])
                raise ShapeError(f"the new {name} for the cache must have shape (B, ..., T, F) = "
                                 f"({lead}, T, {store.shape[-1]}); got {fmt_shape(x.shape)}"
                                 " (was the cache made for another batch size or layer?)")
            t = x.shape[-2]
        end = self.length + t
        if end > self.max_len:
            raise ShapeError(f"the KV cache is full: it holds {self.length} of max_len = {self.max_len} tokens "
                             f"and cannot take {t} more; make it with new_cache(batch, max_len >= {end})")
        for name, x in new.items():
            self.arrays[name][..., self.length:end, :] = x
        return {name: a[..., :end, :] for name, a in self.arrays.items()}

    def advance(self, t: int) -> None:
        """Mark ``t`` more tokens as filled (after a successful :meth:`write`)."""
        self.length += t

    def reset(self) -> None:
        """Forget every stored token (the memory is reused)."""
        self.length = 0

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n} {fmt_shape(a.shape)}" for n, a in self.arrays.items())
        return f"{type(self).__name__}({self.length}/{self.max_len} tokens, {shapes}, {self.nbytes} bytes)"


class KVCache(Cache):
    """Keys ``k (B, Hkv, max_len, D)`` and values ``v (B, Hkv, max_len, Dv)`` of one layer.

    Keys are stored after RoPE (each rotated by its own position), as in Llama.
    """

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, d_head: int, dtype=np.float32,
                 d_value: int | None = None):
        batch, max_len = positive_int("batch", batch), positive_int("max_len", max_len)
        d_value = d_head if d_value is None else d_value
        super().__init__({"k": np.zeros((batch, n_kv_heads, max_len, d_head), dtype=dtype),
                          "v": np.zeros((batch, n_kv_heads, max_len, d_value), dtype=dtype)})


class LatentCache(Cache):
    """MLA's cache: one array ``latent (B, 1, max_len, d_latent + d_rope)`` per layer.

    Columns ``[:d_latent]`` hold the compressed ``c_KV`` of each token (keys and values
    of every head come up from it), columns ``[d_latent:]`` the decoupled RoPE key
    ``k_R`` shared by all heads. Kept as one array so that decoding attends to it in
    place: the keys are whole rows, the values a view of the first ``d_latent`` columns.
    """

    def __init__(self, batch: int, max_len: int, d_latent: int, d_rope: int = 0, dtype=np.float32):
        batch, max_len = positive_int("batch", batch), positive_int("max_len", max_len)
        self.d_latent, self.d_rope = d_latent, d_rope
        super().__init__({"latent": np.zeros((batch, 1, max_len, d_latent + d_rope), dtype=dtype)})


# --- bytes per token ------------------------------------------------------------------------

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
    if d_head is None and d_model % n_heads:
        raise ShapeError(f"d_model must be a multiple of n_heads; got d_model = {d_model}, n_heads = {n_heads}")
    n_kv_heads = positive_int("n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads:
        raise ShapeError(f"n_heads must be a multiple of n_kv_heads; got {n_heads} and {n_kv_heads}")
    d_latent, d_rope = positive_int("d_latent", d_latent), positive_int("d_rope", d_rope, 0)
    n_layers = positive_int("n_layers", n_layers)
    d_head = d_model // n_heads if d_head is None else positive_int("d_head", d_head)
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
