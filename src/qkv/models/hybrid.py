"""Layer patterns of a hybrid :class:`~qkv.models.GPT`: which mixer each block has, and how it is sized.

``GPTConfig(layers=...)`` names one token mixer per block; the rest of the block is the GPT's
(pre-norm residual, LayerNorm, the MLP, the residual dropout)::

    x = x + drop(mixer(ln_1(x)))
    x = x + drop(mlp(ln_2(x)))

The mixers, each sized from ``n_embd = C``, ``n_head = H`` (``C / H`` per head) so that one
config makes every kind:

====================  =========================================================================
``attention``         softmax :class:`~qkv.nn.MultiHeadAttention`, the GPT's as before (GQA,
                      RoPE, attention dropout); ``attention:window=W`` sees its own key and the
                      W before it (Griffin's local attention), ``attention:chunk=N`` its chunk of N;
                      ``attention:conv=K`` puts Zoology's BaseConv (a short causal convolution of K
                      taps, :class:`~qkv.nn.ConvAttention`) before it; options join by ``:``
                      (``attention:window=64:conv=3``)
``mamba2``            :class:`~qkv.nn.Mamba2`: H heads of ``C / H`` (inner width C), SSD state
                      16, 1 group, conv 4, projection biases as ``bias``
``gated_delta``       :class:`~qkv.nn.GatedDeltaNet`: H key heads and H value heads of ``C / H``,
                      conv 4 (no biases, as Qwen3-Next)
``rglru``             :class:`~qkv.nn.RGLRU`: LRU width C in H gate blocks, conv 4
``linear``            causal :class:`~qkv.nn.LinearAttention`, H heads (``n_kv_head`` kv heads)
``baseconv``          :class:`~qkv.nn.ConvMixer`: Zoology's BaseConv alone, ``baseconv:kernel=K``
                      taps (default 3)
``based``             :class:`~qkv.nn.BasedAttention`: Based's Taylor linear attention, H heads,
                      ``based:feature=F`` query/key features a head (default 16)
====================  =========================================================================

State sizes: ``mamba2:expand=E`` makes the inner width ``E·C`` (heads of ``E·C / H``; Mamba-2's
and Zoology's ``expand = 2``), ``gated_delta:expand_v=E`` the value heads ``E·C / H`` wide
(Gated DeltaNet's ``expand_v = 2``); both default to 1, the layers as before.

Named patterns, repeated to ``n_layer`` (layer ``i`` takes entry ``i mod period``):

- ``jamba``: period 8, attention at position 4 of each 8 (Jamba's ``attn_layer_offset = 4``),
  Mamba-2 elsewhere; needs ``n_layer >= 5`` so that one layer is attention.
- ``qwen3-next``: period 4, three Gated DeltaNet then attention (layers 3, 7, ...); ``n_layer >= 4``.
- ``griffin``: period 3, two RG-LRU then local attention of window 64 (RecurrentGemma's
  order); ``n_layer >= 3``.

A list (or comma-separated names) of ``n_layer`` entries gives each layer; a shorter list
repeats when ``n_layer`` is a multiple of its length.
"""
from __future__ import annotations

from ..errors import ShapeError
from ..nn import BasedAttention, ConvAttention, ConvMixer, GatedDeltaNet, LinearAttention, Mamba2, RGLRU

MIXERS = ("attention", "mamba2", "gated_delta", "rglru", "linear", "baseconv", "based")
ATTENTION_OPTIONS = ("window", "chunk", "conv")
OPTIONS = {"attention": ATTENTION_OPTIONS, "mamba2": ("expand",), "gated_delta": ("expand_v",),
           "baseconv": ("kernel",), "based": ("feature",)}  # each mixer's ``name:key=N`` options
# name -> (period, {position in the period: mixer}, the rest); n_layer must reach the last special position
PATTERNS = {
    "jamba": (8, {4: "attention"}, "mamba2"),
    "qwen3-next": (4, {3: "attention"}, "gated_delta"),
    "griffin": (3, {2: "attention:window=64"}, "rglru"),
}
MAMBA2_STATE = 16   # the SSD state size of a GPT's Mamba-2 layers
CONV_KERNEL = 4     # the short convolution of every recurrent mixer


def parse_mixer(token: str) -> tuple[str, dict]:
    """``"attention:window=64:conv=3"`` -> ``("attention", {"window": 64, "conv": 3})``; a ShapeError
    naming ``layers`` otherwise. Options (:data:`OPTIONS`) are ``key=N`` (N >= 1), each at most once,
    joined by ``:``."""
    if not isinstance(token, str):
        raise ShapeError(f"layers must name mixers ({', '.join(MIXERS)}); got {token!r}")
    name, *opts = token.strip().split(":")
    if name not in MIXERS:
        raise ShapeError(f"layers: each entry must be one of {list(MIXERS)} (or a pattern {sorted(PATTERNS)} for "
                         f"the whole list); got {token!r}")
    parsed = {}
    for opt in opts:
        key, _, value = opt.partition("=")
        if key not in OPTIONS.get(name, ()) or key in parsed or not value.isdigit() or int(value) < 1:
            if name != "attention" and name in OPTIONS:
                allowed = ", ".join(f"{name}:{k}=N" for k in OPTIONS.get(name, ())) or "none"
                raise ShapeError(f"layers: {name}'s options are {allowed} (N >= 1), each at most once; "
                                 f"got {token!r}")
            raise ShapeError(f"layers: attention's options are written attention:window=W, attention:chunk=N, "
                             f"attention:conv=K (W, N, K >= 1), each at most once, joined by ':' "
                             f"(attention:window=64:conv=3); got {token!r}")
        parsed[key] = int(value)
    return name, parsed


def normalise(layers):
    """``layers`` as GPTConfig keeps it: None (every block attention), a pattern's name, or a
    tuple of mixer tokens (from a list, a tuple or a comma-separated string)."""
    if layers is None or (isinstance(layers, str) and layers in PATTERNS):
        return layers
    if isinstance(layers, str):
        layers = layers.split(",")
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ShapeError(f"layers must be None, a pattern {sorted(PATTERNS)}, or a non-empty list of mixers "
                         f"({', '.join(MIXERS)}); got {layers!r}")
    tokens = tuple(t.strip() if isinstance(t, str) else t for t in layers)
    for t in tokens:
        parse_mixer(t)
    return tokens


def resolve(layers, n_layer: int) -> tuple[str, ...]:
    """The mixer token of each of the ``n_layer`` blocks (``layers`` normalised)."""
    if layers is None:
        return ("attention",) * n_layer
    if isinstance(layers, str):
        period, special, rest = PATTERNS[layers]
        need = max(special) + 1
        if n_layer < need:
            raise ShapeError(f"n_layer must be >= {need} for layers={layers!r} (its attention layer is layer "
                             f"{max(special)} of each {period}); got n_layer = {n_layer}")
        return tuple(special.get(i % period, rest) for i in range(n_layer))
    if n_layer % len(layers):
        raise ShapeError(f"layers has {len(layers)} entries, which must be n_layer = {n_layer} or divide it "
                         f"(a shorter list repeats)")
    return tuple(layers) * (n_layer // len(layers))


def make_mixer(token: str, c, rng, attention):
    """The mixer of one block for config ``c`` (a GPTConfig), drawing from ``rng``;
    ``attention`` makes the softmax layers (MultiHeadAttention, or a ring layer)."""
    name, opts = parse_mixer(token)
    kw = dict(dtype=c.dtype, rng=rng)
    hs = c.n_embd // c.n_head
    if name == "attention":
        conv = opts.pop("conv", None)
        layer = attention(c.n_embd, c.n_head, n_kv_heads=c.n_kv_head, causal=True, bias=c.bias,
                          rope=c.positions == "rope", rope_base=c.rope_base, dropout=c.dropout, **opts, **kw)
        return layer if conv is None else ConvAttention(layer, conv, rng=rng)
    if name == "mamba2":
        return Mamba2(c.n_embd, c.n_head, hs * opts.get("expand", 1), MAMBA2_STATE, conv_kernel=CONV_KERNEL,
                      bias=c.bias, **kw)
    if name == "gated_delta":
        return GatedDeltaNet(c.n_embd, c.n_head, c.n_head, hs, hs * opts.get("expand_v", 1), conv_kernel=CONV_KERNEL,
                             **kw)
    if name == "baseconv":
        return ConvMixer(c.n_embd, opts.get("kernel", 3), **kw)
    if name == "based":
        return BasedAttention(c.n_embd, c.n_head, opts.get("feature", 16), **kw)
    if name == "rglru":
        return RGLRU(c.n_embd, c.n_embd, c.n_head, conv_width=CONV_KERNEL, **kw)
    return LinearAttention(c.n_embd, c.n_head, n_kv_heads=c.n_kv_head, causal=True, bias=c.bias, **kw)


# the mixers' input and output projections, drawn normal(0, 0.02) as the GPT's other matrices
# (the output one scaled as a residual projection); their other arrays keep the layer's own init
MIXER_IN = ("W_in", "W_x", "W_y", "W_Q", "W_K", "W_V")
MIXER_OUT = ("W_out", "W_O")
