"""``qkv bench --suite hf-hybrid``: transformers' hybrid models with their recurrent kernel
functions on qkv's (``register_hf(recurrent=True)``, :mod:`qkv.torch.hf_kernels`) against the
same model on transformers' torch fallbacks, measured in the same run, alternating.

Models (random weights, float32, batch 1, 4 layers, hidden 512; quick: hidden 32, 2 layers):

- ``qwen3-next``: ``Qwen3NextForCausalLM``, three Gated DeltaNet layers then one attention layer
  (``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``, ``causal_conv1d_*``);
- ``mamba-2``: ``Mamba2ForCausalLM``, four Mamba-2 mixers (``mamba_chunk_scan_combined``,
  ``selective_state_update``; in training ``mamba_split_conv1d_scan_combined``);
- ``kimi``: ``KimiLinearForCausalLM``, three KDA layers then one MLA layer (``chunk_kda``,
  ``fused_recurrent_kda``).

Each at T = 2048 and 8192 (quick: 32): ``prefill`` (the logits and the cache under
``no_grad``), ``train`` (the loss and ``backward()``, ``model.train()``) and ``decode`` (one
token with the cache of the prefill; the cache grows by a token a repeat). A row:
``family``, ``shape``, ``what``, ``qkv_s``, ``peer_s`` (medians), ``ratio`` (qkv ÷ peer),
``peer_kernel_s`` (in one more call of the peer, after the timed ones: the seconds spent inside
the functions qkv replaces, the rest being what both sides run alike) and ``bound`` (``peer_s ÷
(peer_s - peer_kernel_s)``: the most any replacement of those functions could gain),
``qkv_kernel_s`` (the same clock on qkv's side: the seconds inside qkv's functions) and
``kernel_ratio`` (``peer_kernel_s ÷ qkv_kernel_s``: the functions' own speed-up), and
``served`` / ``missing``: the functions qkv.torch.hf_kernels had, and those it did not have
yet (transformers' path ran for those on both sides).
"""
from __future__ import annotations

import contextlib
import functools
import importlib

import time

from .table import Table
from .timing import alternate

KINDS = ("qwen3-next", "mamba-2", "kimi")
WHATS = ("prefill", "train", "decode")
FULL = dict(hidden=512, layers=4, ts=(2048, 8192))
QUICK = dict(hidden=32, layers=2, ts=(32,))


def config(kind: str, hidden: int, layers: int):
    """A ``kind``-like transformers config: the recurrent layers first, attention last."""
    from transformers import CONFIG_MAPPING

    heads = max(2, hidden // 128)
    common = dict(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    if kind == "qwen3-next":
        return CONFIG_MAPPING["qwen3_next"](
            **common, linear_num_key_heads=heads, linear_num_value_heads=2 * heads, linear_key_head_dim=hidden // heads,
            linear_value_head_dim=hidden // heads, num_experts=0, mlp_only_layers=list(range(layers)),
            layer_types=["linear_attention"] * (layers - 1) + ["full_attention"])
    if kind == "mamba-2":
        common.pop("head_dim")
        return CONFIG_MAPPING["mamba2"](**common, num_heads=2 * hidden // 64, head_dim=64, expand=2, state_size=64,
                                        n_groups=1, chunk_size=64 if hidden >= 128 else 8)
    if kind == "kimi":
        lh = hidden // 64 if hidden >= 128 else 2
        return CONFIG_MAPPING["kimi_linear"](
            **common, num_experts=0, kv_lora_rank=hidden // 4, qk_rope_head_dim=16, qk_nope_head_dim=hidden // heads,
            v_head_dim=hidden // heads, first_k_dense_replace=layers,
            linear_attn_config={"kda_layers": list(range(1, layers)), "full_attn_layers": [layers], "head_dim": 64
                                if hidden >= 128 else 8, "num_heads": lh, "short_conv_kernel_size": 4})
    raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")


def model(kind: str, hidden: int, layers: int, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    attn = "eager" if kind == "mamba-2" else "sdpa"  # Mamba-2 has no attention layer (and refuses sdpa)
    return AutoModelForCausalLM.from_config(config(kind, hidden, layers), attn_implementation=attn,
                                            experts_implementation="eager").eval()


@contextlib.contextmanager
def _switch(module):
    """Yields ``use(flag)``: each of ``module``'s replaceable functions that qkv serves becomes
    one that calls qkv's while ``use(True)`` was last said and transformers' while ``use(False)``
    was; all put back on exit. Switching is one assignment, so neither side's clock counts
    patching the module (0.1-0.2 ms, a tenth of a small decoding step)."""
    from qkv.torch import hf_recurrent

    theirs = {a: o for a, o in vars(module).items() if hf_recurrent.kernel_name(o)}
    hf_recurrent.patch_module(module)
    ours = {a: getattr(module, a) for a in theirs if getattr(module, a) is not theirs[a]}
    hf_recurrent.unpatch_module(module)
    flag = [False]

    def switching(attr):
        @functools.wraps(theirs[attr])
        def call(*args, **kwargs):
            return (ours if flag[0] else theirs)[attr](*args, **kwargs)
        return call
    try:
        for a in ours:
            setattr(module, a, switching(a))
        yield lambda on: flag.__setitem__(0, on)
    finally:
        for a, o in theirs.items():
            setattr(module, a, o)


def _sides(use, fn, peer_fn=None):
    """``{"qkv": ..., "peer": ...}``: ``fn`` on qkv's functions, ``peer_fn`` (default ``fn``) on
    transformers'."""
    peer_fn = peer_fn or fn

    def qkv_side():
        use(True)
        return fn()

    def peer_side():
        use(False)
        return peer_fn()
    return {"qkv": qkv_side, "peer": peer_side}


def _calls(m, T: int):
    """``{what: callable}`` for one model at context T."""
    import torch

    ids = torch.randint(1, 512, (1, T), generator=torch.Generator().manual_seed(T))

    def prefill():
        m.eval()
        with torch.no_grad():
            return m(ids, use_cache=True)

    def train():
        m.train()
        m.zero_grad(set_to_none=True)
        m(ids, labels=ids).loss.backward()
        m.eval()

    state = {}

    def decode():
        if "cache" not in state:
            state["cache"], state["next"] = prefill().cache, ids[:, -1:]
        with torch.no_grad():
            out = m(state["next"], cache=state["cache"], use_cache=True)   # transformers 5.25's name
        state["cache"] = out.cache
    return {"prefill": prefill, "train": train, "decode": decode}


def _kernel_seconds(module, fn, qkv: bool = False) -> float:
    """Seconds one call of ``fn`` spends inside ``module``'s replaceable kernel functions (each
    wrapped in a clock for the call, then put back); ``qkv``: inside qkv's functions, with the
    module patched for the call."""
    from qkv.torch import hf_recurrent

    if qkv:
        hf_recurrent.patch_module(module)
        try:
            return _kernel_seconds(module, fn)
        finally:
            hf_recurrent.unpatch_module(module)
    names = [a for a, o in vars(module).items()
             if hf_recurrent.kernel_name(o) or getattr(o, "_qkv_serves", None)]
    saved, spent = {a: getattr(module, a) for a in names}, [0.0]

    def clocked(f):
        @functools.wraps(f)
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t
        return call
    try:
        for a in names:
            setattr(module, a, clocked(saved[a]))
        fn()
    finally:
        for a, o in saved.items():
            setattr(module, a, o)
    return spent[0]


def measure(quick: bool, repeats: int, told=lambda label: None) -> list[dict]:
    from qkv.torch import hf_recurrent

    size = QUICK if quick else FULL
    rows = []
    for kind in KINDS:
        m = model(kind, size["hidden"], size["layers"])
        module = importlib.import_module(type(m).__module__)
        names = sorted({n for n in (hf_recurrent.kernel_name(o) for o in vars(module).values()) if n})
        served = [n for n in names if hf_recurrent.qkv_function(n) is not None]
        for T in size["ts"]:
            for what, fn in _calls(m, T).items():
                told(f"{kind} T={T} {what}")
                # decode: each side its own cache, made by its own prefill (in the warm-up)
                peer_fn = _calls(m, T)["decode"] if what == "decode" else fn
                with _switch(module) as use:
                    med = alternate(_sides(use, fn, peer_fn), repeats, rewarm_below=0 if quick else 1.0)
                q, p = med["qkv"]["wall"], med["peer"]["wall"]
                inside = min(_kernel_seconds(module, peer_fn), p)
                ours = min(_kernel_seconds(module, fn, qkv=True), q)
                rows.append(dict(family=kind, shape=f"B=1 T={T} hidden={size['hidden']} layers={size['layers']}",
                                 what=what, qkv_s=q, peer_s=p, ratio=q / p if p > 0 else float("nan"),
                                 peer_kernel_s=inside, bound=p / (p - inside) if p > inside else float("inf"),
                                 qkv_kernel_s=ours, kernel_ratio=inside / ours if ours > 0 else float("nan"),
                                 served=served, missing=[n for n in names if n not in served]))
    return rows


def table(rows: list[dict], repeats: int | None = None, threads: int | None = None, smoke: str = "") -> Table:
    """The rows of :func:`measure`: each model's passes, qkv's kernel functions against transformers'."""
    runs = f", medians of {repeats}" if repeats else ""
    t = Table(f"transformers' hybrids, 4 layers, hidden 512, float32, B=1: the recurrent kernel functions on qkv "
              f"(register_hf(recurrent=True)) against transformers' torch fallbacks, {threads} thread(s), wall clock"
              f"{runs}{smoke}", ["model", "T", "pass", "qkv s", "peer s", "peer ÷ qkv", "peer in kernels",
                               "bound", "kernels: peer ÷ qkv"], left=3)
    for r in rows:
        t.rows.append([r["family"], r["shape"].split()[1][2:], r["what"], f"{r['qkv_s']:.4f}", f"{r['peer_s']:.4f}",
                       f"{r['peer_s'] / r['qkv_s']:.2f}", f"{r['peer_kernel_s'] / r['peer_s']:.0%}",
                       f"{r['bound']:.2f}", f"{r.get('kernel_ratio', float('nan')):.2f}"])
    t.notes.append("peer ÷ qkv: above 1, qkv is faster (issue 52's target: 2 for prefill and train, 1 for decode). "
                   "peer in kernels: the share of the peer's time inside the functions qkv replaces; bound: peer ÷ "
                   "(peer - that time), the speed-up if qkv's functions took no time at all (the projections, MLPs "
                   "and attention layers run the same on both sides); kernels: peer ÷ qkv: the replaced functions' own speed-up, "
                   "each side's time inside them clocked in one more call. In a train row the clock holds the "
                   "functions' forward only (their backward runs in autograd after they return), so its share and "
                   "bound are lower limits and its kernel ratio the forward's")
    return t


def count(quick: bool) -> int:
    return len(KINDS) * len((QUICK if quick else FULL)["ts"]) * len(WHATS)


def suite(p, progress, why_not: str) -> tuple[list[dict], str | None]:
    """The suite's rows for the plan ``p`` of ``suites.run_suites``, or ``([], reason)``."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return [], why_not
    return measure(p.quick, p.repeats, told=lambda label: progress(1)), None
