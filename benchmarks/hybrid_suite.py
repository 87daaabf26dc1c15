"""``qkv bench --suite hybrid`` and ``--suite hybrid-decode``: qkv's GPT with each layer pattern of
:mod:`qkv.models.hybrid`, trained as a language model and decoding at long context.

``hybrid`` trains nanoGPT's CPU recipe (:func:`gpt_suite.recipe`: block 64, batch 12, width 128,
4 heads, lr 1e-3 with warm-up 100 and cosine decay, AdamW, clipping 1.0; 2000 steps, or
``--steps``) on Shakespeare (a quick run: the smoke text, 5 steps) once per entry of
:data:`PATTERNS`, one after another in this process, each from its own initial weights (seed 0)
on the same batches (the run's data Generator made afresh per pattern). ``n_layer`` is the
recipe's 4 where the pattern holds an attention layer in 4 blocks, else the fewest that does:
jamba's attention is layer 4 of each 8, so it gets 5 (four Mamba-2, one attention); attention
runs at both depths, 4 and 5, so that jamba has an attention model of its own depth beside it. Griffin's
local attention has window 64, the recipe's whole block, so there it sees what full attention
sees. One row per pattern (``results["hybrid"]``):

- ``part``: ``"lm"``; ``pattern`` (``"attention"``: every block softmax attention, GPT-2's),
  ``n_layer``, ``kinds`` (each block's mixer), ``params`` (scalars, the tied head once);
- ``ms_per_step``: the median wall time of one training step (forward, loss, backward,
  clipping, AdamW) after the first tenth of the steps (at most 10), as the gpt suite's;
  ``tokens_per_s`` = B·T / that;
- ``val_loss``: the mean loss over ``FINAL_EVAL_ITERS`` val batches after the last step (the
  same batches for every pattern); ``curve``: the val loss every ``eval_interval`` steps over
  the recipe's 20 eval batches; ``train_loss``: the mean of the last 50 steps' losses;
- ``steps``, ``vocab``, ``data`` (where the text came from), ``config`` (the recipe).

``hybrid-decode`` times one cached decoding step, ``GPT.forward(tok (1, 1), cache=cache)``: the
step :meth:`GPT.generate` takes, through a :class:`~qkv.models.gpt_cache.GPTCache`, at context
L in :data:`CONTEXTS`, batch 1, random weights (the same patterns and ``n_layer``; the recipe's
width, and unless quick the width of nanoGPT's GPU recipe too, :data:`SIZES`), with RoPE
positions (``block_size`` above the longest L). The cache is filled synthetically, not by an
L-token prefill: the attention layers' keys and values get L random tokens (their lengths set
to L), the recurrent layers' conv windows and states random values; then the timed step is the
model's own step at length L, the cache's lengths put back to L after each. Rows
(``results["hybrid_decode"]``):

- ``part``: ``"decode"``; ``pattern``, ``size`` (``"cpu"`` or ``"gpu-size"``), ``n_layer``,
  ``n_embd``, ``n_head``, ``context`` (L);
- ``ms_per_token``: the median over ``repeats`` rounds of the mean of ``STEPS_PER_ROUND`` steps;
  ``tokens_per_s`` = 1000 / that;
- ``cache_bytes``: the bytes of every array of the cache of one sequence (``nbytes``, B = 1; a
  KV cache is allocated for L + 1 tokens, the step's own included, a windowed layer's for its
  last W: Griffin's is flat past 64), split into
  ``attention_bytes`` (the KV caches) and ``state_bytes`` (the recurrent layers' conv windows and
  states): the second does not depend on L.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from .gpt_suite import _eval_batches, _set_threads, _shape, _warm, read_text, recipe

# (pattern name as reported, GPTConfig layers, n_layer)
PATTERNS = (("attention", None, 4), ("attention", None, 5), ("qwen3-next", "qwen3-next", 4),
            ("griffin", "griffin", 4), ("jamba", "jamba", 5))
STEPS = {"full": 2000, "quick": 5}
FINAL_EVAL_ITERS = {"full": 200, "quick": 2}
CONTEXTS = {"full": (1024, 4096, 16384, 65536), "quick": (64, 256)}
# decode model widths: nanoGPT's CPU recipe's, and its GPU recipe's (unless quick)
SIZES = {"full": (("cpu", 128, 4), ("gpu-size", 384, 6)), "quick": (("cpu", 32, 2),)}
DECODE_VOCAB = 65
STEPS_PER_ROUND = 5


def lm_count(quick: bool) -> int:
    return len(PATTERNS)


def decode_count(quick: bool) -> int:
    key = "quick" if quick else "full"
    return len(PATTERNS) * len(SIZES[key]) * len(CONTEXTS[key])


def _train(name: str, layers, n_layer: int, ds, steps: int, quick: bool) -> dict:
    """One pattern trained ``steps`` steps (see the module docstring)."""
    from qkv.training.loop import data_rng, eval_rng, gpt_config, lr_at

    from .gpt_suite import QkvSide

    cfg = recipe(steps, quick, layers=layers, n_layer=n_layer)
    side = QkvSide(gpt_config(cfg, ds.tokenizer.vocab_size), cfg)
    rng, times, losses, curve = data_rng(cfg.seed), [], [], []
    for step in range(steps):
        x, y = ds.batch("train", cfg.batch_size, cfg.block_size, rng)
        t0 = time.perf_counter()
        losses.append(side.step(x, y, lr_at(step, cfg)))
        times.append(time.perf_counter() - t0)
        done = step + 1
        if done % cfg.eval_interval == 0 and done < steps:
            batches = _eval_batches(ds, cfg, eval_rng(cfg.seed), cfg.eval_iters)
            curve.append({"step": done, "val_loss": side.eval_loss(batches)})
    n_eval = FINAL_EVAL_ITERS["quick" if quick else "full"]
    val = side.eval_loss(_eval_batches(ds, cfg, eval_rng(cfg.seed), n_eval))
    warm = _warm(steps)
    sec = statistics.median(times[warm:]) if steps > warm else float("nan")
    return {"part": "lm", "pattern": name, "n_layer": n_layer, "kinds": list(side.model.config.layer_kinds),
            "params": int(side.model.n_params), "steps": steps, "ms_per_step": 1e3 * sec,
            "tokens_per_s": cfg.batch_size * cfg.block_size / sec, "val_loss": val,
            "train_loss": float(np.mean(losses[-50:])), "first_loss": losses[0], "curve": curve,
            "warmup_steps": warm, "eval_iters": n_eval, "vocab": ds.tokenizer.vocab_size, "config": _shape(cfg)}


def measure_lm(*, quick: bool, steps: int | None, threads: int, data: str | None = None, told=None) -> list[dict]:
    """One trained row per pattern of :data:`PATTERNS` (see the module docstring)."""
    from qkv.training.chardata import CharDataset

    told = told or (lambda label: None)
    steps = STEPS["quick" if quick else "full"] if steps is None else steps
    limiter = _set_threads(threads, False)  # noqa: F841 (qkv's and the BLAS pool's threads, held while it trains)
    text, source = read_text(data, quick)
    ds = CharDataset(text)
    rows = []
    for name, layers, n_layer in PATTERNS:
        told(f"{name}, {n_layer} layers, {steps} steps")
        rows.append({**_train(name, layers, n_layer, ds, steps, quick), "data": source})
    return rows


def decode_model(layers, n_layer: int, n_embd: int, n_head: int, max_len: int):
    """A random-weight GPT of the pattern, RoPE positions, ``block_size`` past ``max_len``."""
    from qkv.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=DECODE_VOCAB, block_size=max_len + 1, n_layer=n_layer, n_head=n_head,
                         n_embd=n_embd, bias=False, positions="rope", layers=layers))


def filled_cache(model, length: int, rng: np.random.Generator):
    """A batch-1 cache of ``model`` holding ``length`` tokens of random keys, values and states,
    room for one more (see the module docstring)."""
    from qkv.nn import Cache

    cache = model.new_cache(1, length + 1)
    for entry in cache:
        if isinstance(entry, Cache):
            for a in entry.arrays.values():
                a[..., :length, :] = rng.standard_normal(a[..., :length, :].shape)
        else:
            for a in (entry.conv, entry.recurrent):
                a[...] = 0.1 * rng.standard_normal(a.shape)
            entry.length = length
    set_length(cache, length)
    return cache


def set_length(cache, length: int) -> None:
    """Put every entry of ``cache`` (and the cache) back to ``length`` tokens held."""
    from qkv.nn import Cache

    for entry in cache:
        if isinstance(entry, Cache):
            entry.lengths = np.full(cache.batch, length, dtype=np.int64)
        else:
            entry.length = length
    cache.lengths = np.full(cache.batch, length, dtype=np.int64)


def cache_bytes(cache) -> tuple[int, int]:
    """``(attention bytes, state bytes)`` of one sequence's cache (B = 1): every array's nbytes."""
    from qkv.nn import Cache

    kv = sum(e.nbytes for e in cache if isinstance(e, Cache))
    return kv // cache.batch, sum(e.nbytes for e in cache if not isinstance(e, Cache)) // cache.batch


def _decode_case(model, length: int, repeats: int, rng) -> dict:
    cache = filled_cache(model, length, rng)
    tok = rng.integers(0, DECODE_VOCAB, (1, 1))
    model.eval()
    model.forward(tok, cache=cache)  # warm-up
    rounds = []
    for _ in range(repeats):
        t = 0.0
        for _ in range(STEPS_PER_ROUND):
            set_length(cache, length)
            t0 = time.perf_counter()
            model.forward(tok, cache=cache)  # (1, 1) -> (1, 1, V): the step generate takes
            t += time.perf_counter() - t0
        rounds.append(t / STEPS_PER_ROUND)
    kv, state = cache_bytes(cache)
    ms = 1e3 * statistics.median(rounds)
    return {"ms_per_token": ms, "tokens_per_s": 1e3 / ms, "cache_bytes": kv + state, "attention_bytes": kv,
            "state_bytes": state}


def measure_decode(*, quick: bool, repeats: int, told=None) -> list[dict]:
    """One row per size, pattern and context (see the module docstring)."""
    told = told or (lambda label: None)
    key = "quick" if quick else "full"
    rng = np.random.default_rng(0)
    rows = []
    for size, n_embd, n_head in SIZES[key]:
        for name, layers, n_layer in PATTERNS:
            model = decode_model(layers, n_layer, n_embd, n_head, max(CONTEXTS[key]))
            for length in CONTEXTS[key]:
                told(f"{name} ({size}), L={length}")
                rows.append({"part": "decode", "pattern": name, "size": size, "n_layer": n_layer, "n_embd": n_embd,
                             "n_head": n_head, "context": length, "kinds": list(model.config.layer_kinds),
                             **_decode_case(model, length, repeats, rng)})
            del model
    return rows


def _told(progress, suite: str):
    started = []

    def told(label):  # a label before each step: the step before it is done
        progress(1 if started else 0, description=f"{suite}: {label}")
        started.append(label)
    return told


def suite(p, progress) -> tuple[list[dict], str | None]:
    """The ``hybrid`` suite's rows for the plan ``p`` of ``suites.run_suites``, or ``([], reason)``
    when the default text cannot be had."""
    from qkv.training.corpus import CorpusError

    try:
        rows = measure_lm(quick=p.quick, steps=p.steps, threads=p.threads, data=p.data, told=_told(progress, "hybrid"))
    except CorpusError as err:
        return [], f"{err}"
    progress(1)
    return rows, None


def decode_suite(p, progress) -> tuple[list[dict], None]:
    """The ``hybrid-decode`` suite's rows for the plan ``p``."""
    rows = measure_decode(quick=p.quick, repeats=p.repeats, told=_told(progress, "hybrid-decode"))
    progress(1)
    return rows, None
