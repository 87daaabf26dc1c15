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
``peer_kernel_s`` and ``qkv_kernel_s`` (the
seconds each side's timed calls spent inside the functions qkv replaces, clocked in those very
calls: medians), ``peer_rest_s`` and ``qkv_rest_s`` (the median over the timed calls of a call's
wall clock less its seconds inside them: what both sides run alike, transformers' own code),
``bound`` (``peer_s ÷ peer_rest_s``: the most any replacement of those functions could gain),
``kernel_ratio`` (``peer_kernel_s ÷ qkv_kernel_s``: the functions' own speed-up), ``repeats``
(the timed calls of each side: :data:`DECODE_TIMES` times the plan's for a decoding row), and
``served`` / ``missing``: the functions qkv.torch.hf_kernels had, and those it did not have
yet (transformers' path ran for those on both sides).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import statistics
import time

from .table import Table
from .timing import rounds

KINDS = ("qwen3-next", "mamba-2", "kimi")
WHATS = ("prefill", "train", "decode")
FULL = dict(hidden=512, layers=4, ts=(2048, 8192))
DECODE_TIMES = 5    # a decoding row times this many times the repeats: a token takes milliseconds, and with
                    # 3 repeats one slow call moved a row by a third (the same code 0.87x in a record, 1.06-1.15x
                    # in three runs of 9 after it), where the replaced functions are 4-40 % of the step
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
    patching the module (0.1-0.2 ms, a tenth of a small decoding step). Every replaceable
    function, served or not, adds the seconds of its calls to ``use.spent[0]`` (a call inside
    another's counted once): each side's time inside them, clocked in the call the wall clock
    times. (Clocked in one more call after the timed ones, the peer's share was another call's:
    where it is 90 % of the call, the bound ``p ÷ (p - inside)`` moved by a third with the
    noise of one call.)"""
    from qkv.torch import hf_recurrent

    theirs = {a: o for a, o in vars(module).items() if hf_recurrent.kernel_name(o)}
    hf_recurrent.patch_module(module)
    ours = {a: getattr(module, a) for a in theirs if getattr(module, a) is not theirs[a]}
    hf_recurrent.unpatch_module(module)
    flag, depth = [False], [0]

    def use(on: bool) -> None:
        flag[0] = on
    use.spent = [0.0]

    def switching(attr):
        @functools.wraps(theirs[attr])
        def call(*args, **kwargs):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return (ours if flag[0] and attr in ours else theirs)[attr](*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    use.spent[0] += time.perf_counter() - t
        return call
    try:
        for a in theirs:
            setattr(module, a, switching(a))
        yield use
    finally:
        for a, o in theirs.items():
            setattr(module, a, o)


def _sides(use, fn, peer_fn=None):
    """``{"qkv": ..., "peer": ...}``: ``fn`` on qkv's functions, ``peer_fn`` (default ``fn``) on
    transformers'; each returns the seconds its call spent inside the replaceable functions."""
    peer_fn = peer_fn or fn

    def side(on, f):
        def run():
            use(on)
            use.spent[0] = 0.0
            f()
            return use.spent[0]
        return run
    return {"qkv": side(True, fn), "peer": side(False, peer_fn)}


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


def split(runs: list, inside: list) -> tuple:
    """``(wall, inside, rest)``: medians over one side's timed calls (``runs`` of ``(wall s, cpu s)``,
    ``inside`` each call's seconds inside the replaced functions) of the wall clock, the time inside
    and each call's wall less its own time inside."""
    walls = [w for w, _ in runs]
    return (statistics.median(walls), statistics.median(inside),
            statistics.median(w - k for w, k in zip(walls, inside)))


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
                inside, n = {}, repeats * (DECODE_TIMES if what == "decode" else 1)
                with _switch(module) as use:
                    runs = rounds(_sides(use, fn, peer_fn), n, rewarm_below=0 if quick else 1.0, returns=inside)
                (q, qk, q_rest), (p, pk, p_rest) = (split(runs[s], inside[s]) for s in ("qkv", "peer"))
                rows.append(dict(family=kind, shape=f"B=1 T={T} hidden={size['hidden']} layers={size['layers']}",
                                 what=what, qkv_s=q, peer_s=p, ratio=q / p if p > 0 else float("nan"),
                                 peer_kernel_s=pk, peer_rest_s=p_rest, qkv_kernel_s=qk, qkv_rest_s=q_rest,
                                 bound=p / p_rest if p_rest > 0 else float("inf"),
                                 kernel_ratio=pk / qk if qk > 0 else float("nan"), repeats=n,
                                 served=served, missing=[n for n in names if n not in served]))
    return rows


def table(rows: list[dict], repeats: int | None = None, threads: int | None = None, smoke: str = "") -> Table:
    """The rows of :func:`measure`: each model's passes, qkv's kernel functions against transformers'."""
    runs = f", medians of {repeats}" if repeats else ""
    decode = {r["repeats"] for r in rows if r["what"] == "decode" and "repeats" in r}
    runs += f" (decoding rows: of {', '.join(map(str, sorted(decode)))})" if decode and decode != {repeats} else ""
    t = Table(f"transformers' hybrids, 4 layers, hidden 512, float32, B=1: the recurrent kernel functions on qkv "
              f"(register_hf(recurrent=True)) against transformers' torch fallbacks, {threads} thread(s), wall clock"
              f"{runs}{smoke}", ["model", "T", "pass", "qkv s", "peer s", "peer ÷ qkv", "peer in kernels",
                               "bound", "of the bound", "kernels: peer ÷ qkv"], left=3)
    for r in rows:
        ratio = r["peer_s"] / r["qkv_s"]
        t.rows.append([r["family"], r["shape"].split()[1][2:], r["what"], f"{r['qkv_s']:.4f}", f"{r['peer_s']:.4f}",
                       f"{ratio:.2f}", f"{r['peer_kernel_s'] / r['peer_s']:.0%}", f"{r['bound']:.2f}",
                       f"{ratio / r['bound']:.2f}", f"{r.get('kernel_ratio', float('nan')):.2f}"])
    # rows recorded before 2026-12-07 20:00 clocked the functions in one more call after the timed ones
    same_calls = all("peer_rest_s" in r for r in rows)
    clock = ("each side's time inside them clocked in its timed calls themselves (medians; the bound from "
             "each call's wall less its own time inside)" if same_calls else
             "each side's time inside them clocked in one more call after the timed ones")
    t.notes.append("peer ÷ qkv: above 1, qkv is faster (issue 52's target: 2 for prefill and train, 1 for decode). "
                   "peer in kernels: the share of the peer's time inside the functions qkv replaces; bound: peer ÷ "
                   "the peer's time outside them, the speed-up if qkv's functions took no time at all (the projections, MLPs "
                   "and attention layers run the same on both sides); of the bound: peer ÷ qkv ÷ bound, the share "
                   "of that speed-up reached; kernels: peer ÷ qkv: the replaced functions' own speed-up, "
                   f"{clock}. In a train row the clock holds the "
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
