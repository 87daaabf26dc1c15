"""``qkv bench --suite hf``: a small Hugging Face decoder on ``attn_implementation="qkv"``
against the same model on ``"sdpa"`` and ``"eager"`` (same weights, inputs and threads).

Models (random weights, no download), float32, in ``eval()`` (no dropout):

- ``llama``: ``LlamaForCausalLM``, hidden size 128, 4 query heads and 2 kv heads (GQA, D = 32),
  2 layers, MLP 344, vocabulary 512, RoPE;
- ``gpt2``: ``GPT2LMHeadModel``, n_embd 128, 4 heads (D = 32), 2 layers, vocabulary 512.

Input: a batch of 4 sequences of T = 256 tokens, no padding (what a training step feeds),
so every layer's mask is plain causal, and no KV cache (``use_cache=False``: a training
step, or scoring a batch). Two passes: ``fwd`` (the logits under ``torch.no_grad()``) and
``fwd+bwd`` (the language-model loss, then ``backward()`` into every parameter). The three sides alternate with the suite's one timing loop
(``timing.rounds``, the first side rotating from repeat to repeat); each side's median is
reported, and each ratio is the median over repeats of qkv's time ÷ the peer's time in the
same repeat (below 1, qkv is faster; issue 22's target is qkv ÷ sdpa ≤ 1.1).

Clocks: the wall clock, and with one thread (``threads=1``: torch, qkv and BLAS all held to
one) the CPU time of the calling thread (``time.thread_time``), which every side's work runs
on then: on a shared machine it counts a side's own work, whatever else the cores do.
"""
from __future__ import annotations

import statistics
import time

from .timing import rounds

IMPLS = ("qkv", "sdpa", "eager")
PASSES = ("fwd", "fwd+bwd")
FULL = dict(families=("llama", "gpt2"), hidden=128, heads=4, kv_heads=2, layers=2, vocab=512, batch=4, t=256)
QUICK = dict(families=("llama", "gpt2"), hidden=32, heads=4, kv_heads=2, layers=1, vocab=64, batch=2, t=16)


def cases(quick: bool) -> list[tuple[str, str]]:
    """``(family, pass)`` of every row, in the order measured."""
    return [(f, p) for f in (QUICK if quick else FULL)["families"] for p in PASSES]


def config(family: str, size: dict):
    """The transformers config of ``family`` at ``size`` (eval-ready: no dropout)."""
    import transformers

    h, n, t = size["hidden"], size["heads"], size["t"]
    if family == "llama":
        return transformers.LlamaConfig(vocab_size=size["vocab"], hidden_size=h, intermediate_size=int(h * 2.6875),
                                        num_hidden_layers=size["layers"], num_attention_heads=n,
                                        num_key_value_heads=size["kv_heads"], max_position_embeddings=t)
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=size["vocab"], n_embd=h, n_layer=size["layers"], n_head=n,
                                       n_positions=t, bos_token_id=None, eos_token_id=None, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    raise ValueError(f"family must be 'llama' or 'gpt2'; got {family!r}")


def models(family: str, size: dict, seed: int = 0) -> dict:
    """``{impl: model}``: one model per attention implementation, the same weights in each."""
    import transformers

    import qkv.torch

    name = qkv.torch.register_hf()
    cls = {"llama": transformers.LlamaForCausalLM, "gpt2": transformers.GPT2LMHeadModel}[family]
    out = {}
    for impl in IMPLS:
        c = config(family, size)
        c._attn_implementation = name if impl == "qkv" else impl
        torch_seed(seed)
        out[impl] = cls(c).eval()
    return out


def torch_seed(seed: int) -> None:
    import torch
    torch.manual_seed(seed)


def step(model, ids, backward: bool):
    """A no-argument callable: the logits (no grad), or the loss and its backward."""
    import torch

    if not backward:
        def fwd():
            with torch.no_grad():
                return model(input_ids=ids, use_cache=False).logits
        return fwd

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss
    return fwd_bwd


def _ratio(times: dict, a: str, b: str) -> float:
    """The median over repeats of ``a``'s time ÷ ``b``'s time in the same repeat."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def suite(p, progress, missing: str):
    """``(rows, None)`` for the plan ``p`` of ``suites.run_suites``, or ``([], why)`` without
    PyTorch or transformers (``missing``: what to say then)."""
    import importlib.util

    if not p.torch:
        return [], "PyTorch was left out (torch=False, --no-torch)" if importlib.util.find_spec("torch") else missing
    if importlib.util.find_spec("transformers") is None:
        return [], missing
    started = []

    def told(label):  # measure says a label before each step: the step before it is done
        progress(1 if started else 0, description=f"hf: {label}")
        started.append(label)
    rows = measure(p.repeats, p.quick, told, threads=p.threads)
    progress(1)
    return rows, None


def measure(repeats: int, quick: bool, progress=None, *, threads: int, seed: int = 0) -> list[dict]:
    """One row per family and pass: ``family``, ``pass``, ``shape`` [B, T], ``size`` (the
    model), ``threads``, ``wall_s`` and ``thread_cpu_s`` ({impl: median}; the latter with one
    thread only, else None), ``qkv_vs_sdpa`` and ``qkv_vs_eager`` (median per-repeat ratios of
    the one-thread CPU times, else of the wall times) and their wall-clock twins ``*_wall``.
    The caller sets the threads of torch and qkv; BLAS is held to ``threads`` here."""
    import torch
    from threadpoolctl import threadpool_limits

    size = QUICK if quick else FULL
    cpu_clock = time.thread_time if threads == 1 else time.process_time
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, size["vocab"], (size["batch"], size["t"]), generator=gen)
    rows = []
    for family, pass_ in cases(quick):
        if progress:
            progress(f"{family} {pass_}")
        ms = models(family, size, seed)
        fns = {impl: step(m, ids, pass_ == "fwd+bwd") for impl, m in ms.items()}
        with threadpool_limits(limits=threads, user_api="blas"):
            runs = rounds(fns, repeats, rotate=True, cpu_clock=cpu_clock)
        wall = {m: [w for w, _ in r] for m, r in runs.items()}
        cpu = {m: [c for _, c in r] for m, r in runs.items()}
        main = cpu if threads == 1 else wall
        rows.append(dict(family=family, **{"pass": pass_}, shape=[size["batch"], size["t"]],
                         size={k: v for k, v in size.items() if k != "families"}, threads=threads,
                         wall_s={m: statistics.median(w) for m, w in wall.items()},
                         thread_cpu_s={m: statistics.median(c) for m, c in cpu.items()} if threads == 1 else None,
                         qkv_vs_sdpa=_ratio(main, "qkv", "sdpa"), qkv_vs_eager=_ratio(main, "qkv", "eager"),
                         qkv_vs_sdpa_wall=_ratio(wall, "qkv", "sdpa"), qkv_vs_eager_wall=_ratio(wall, "qkv", "eager")))
    return rows
