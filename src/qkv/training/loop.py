"""Training a character-level GPT, as nanoGPT's ``train.py`` does on ``shakespeare_char``.

The defaults of :class:`TrainConfig` are nanoGPT's CPU recipe (its README: ``--device=cpu
--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
--lr_decay_iters=2000 --dropout=0.0 --eval_iters=20`` on ``config/train_shakespeare_char.py``):
AdamW with lr 1e-3, betas (0.9, 0.99), weight decay 0.1 (:class:`qkv.nn.AdamW`'s rule: on the
matrices but the embeddings, which nanoGPT decays too), gradient clipping at a global norm
of 1.0, 100 warm-up steps then a cosine decay to ``min_lr = lr / 10`` at ``lr_decay_steps``
(default: ``steps``), an evaluation every 250 steps over 20 batches of each split, and
nanoGPT's ``bias = False`` (no biases in the Linear and LayerNorm layers).

One step::

    x, y  = batch of the train split          (B, T), (B, T)   data stream: the run's Generator
    loss  = model.loss(x, y)                  mean cross-entropy of (B, T, V) logits
    model.backward()                          fills model.grads
    opt.step(lr(step))                        clip to norm 1, AdamW update

With ``grad_accum = N`` the first three lines run for N micro-batches drawn one after another
and the update takes their mean gradient: the gradient of the ``(N·B, T)`` batch of the same
rows (nanoGPT's ``gradient_accumulation_steps``).

A :class:`Run` holds everything that changes while training: the model, the optimizer's
moments and step count, the data Generator, the step and the log. Saved by
:func:`qkv.io.runfiles.save_run` and read back by ``load_run``, a run continues exactly where it
stopped: a run stopped after k steps and resumed gives bit for bit the losses and weights
of one that was not (float64 and float32 alike, on the same machine and threads).

Evaluations draw their batches from a Generator made afresh from the seed each time, so
every evaluation of a run sees the same batches (less noise from one to the next) and
evaluating never moves the training stream.
"""
from __future__ import annotations

import hashlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ShapeError
from .chardata import CharTokenizer, TokenDataset
from .config import DTYPES, TrainConfig

__all__ = ["DTYPES", "Diverged", "Run", "TrainConfig", "check_data", "evaluate", "gpt_config", "lr_at",
           "make_optimizer", "new_run", "train", "train_step"]


def gpt_config(cfg: TrainConfig, vocab_size: int):
    """The :class:`qkv.models.gpt.GPTConfig` of a training config."""
    from ..models.gpt import GPTConfig

    return GPTConfig(vocab_size=cfg.vocab_size or vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
                     n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias,
                     activation=cfg.activation, dtype=DTYPES[cfg.dtype], seed=cfg.seed, layers=cfg.layers)


def every_matrix(layer, name: str, array: np.ndarray) -> bool:
    """nanoGPT's weight-decay rule: every tensor of 2 or more dimensions, the embeddings included."""
    return array.ndim >= 2


def make_optimizer(model, cfg: TrainConfig):
    """AdamW over the model's parameters with the config's betas, weight decay (the embeddings
    too with ``decay_embeddings``) and clipping (none for ``grad_clip = 0``, as nanoGPT)."""
    from ..nn import AdamW

    return AdamW(model, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay,
                 clip=cfg.grad_clip or None, decay=every_matrix if cfg.decay_embeddings else None)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of update ``step`` (0-based): nanoGPT's linear warm-up then cosine to ``min_lr``."""
    from ..nn import cosine_lr

    return cosine_lr(step, lr=cfg.lr, warmup=cfg.warmup, max_steps=cfg.lr_decay_steps, min_lr=cfg.min_lr)


def data_rng(seed: int) -> np.random.Generator:
    """The training batches' Generator of a run with ``seed`` (its state is saved with the run)."""
    return np.random.default_rng((1, seed))


def eval_rng(seed: int) -> np.random.Generator:
    """The evaluation batches' Generator, made afresh for every evaluation."""
    return np.random.default_rng((2, seed))


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class Run:
    """A training run's state: what :func:`train` advances and ``runfiles.save_run`` writes."""

    cfg: TrainConfig
    model: object
    opt: object
    rng: np.random.Generator
    tokenizer: CharTokenizer        # or a BPETokenizer / NoTokenizer (qkv.training.bpe)
    data: dict                      # {"source": path or "shakespeare", "sha256": of the text or folder, "kind"}
    step: int = 0
    seconds: float = 0.0            # training time so far (evaluations included)
    log: dict = field(default_factory=lambda: {"evals": [], "losses": []})
    shapes: set = field(default_factory=set, repr=False, compare=False)  # batch shapes a forward took (not saved)


def new_run(cfg: TrainConfig, dataset: TokenDataset, source: str, text: str | None = None, *,
            data: dict | None = None, model=None, names=None) -> Run:
    """A fresh run of ``cfg`` on ``dataset`` (made from ``text``, read from ``source``; or
    described by ``data``, a folder's record). ``model``: the weights to start from (a GPT of
    ``gpt_config(cfg, ...)``, :func:`qkv.training.finetune.init_model`'s), else new ones.

    A run that needs more memory than the machine has available is refused before anything is
    allocated (:func:`qkv.training.memory.check_fits`; ``names``: how its errors show the
    config's fields, as :meth:`TrainConfig.check`)."""
    from ..models.gpt import GPT
    from .memory import check_fits

    cfg = cfg.resolved()
    if cfg.vocab_size is None:
        cfg.vocab_size = dataset.tokenizer.vocab_size if model is None else model.config.vocab_size
    check_data(cfg, dataset)
    check_fits(cfg, cfg.vocab_size, names)
    model = GPT(gpt_config(cfg, cfg.vocab_size)) if model is None else model
    data = {"source": source, "sha256": text_digest(text), "kind": "text"} if data is None else data
    return Run(cfg, model, make_optimizer(model, cfg), data_rng(cfg.seed), dataset.tokenizer, data)


def check_data(cfg: TrainConfig, dataset: TokenDataset) -> None:
    vocab = dataset.tokenizer.vocab_size
    if cfg.vocab_size is not None and vocab > cfg.vocab_size:
        raise ShapeError(f"the data's vocabulary has {vocab} tokens, more than the model's {cfg.vocab_size}: "
                         f"its ids would fall outside the embedding")
    for name in ("train", "val"):
        n = len(getattr(dataset, name))
        if n <= cfg.block_size:
            raise ShapeError(f"the {name} split has {n} tokens, fewer than block_size + 1 = {cfg.block_size + 1}: "
                             f"use a longer text (the {name} split is "
                             f"{'the first 90' if name == 'train' else 'the last 10'} %) or a smaller --block-size")


def evaluate(model, dataset: TokenDataset, cfg: TrainConfig) -> dict:
    """Mean loss over ``eval_iters`` batches of each split, in eval mode (no dropout), as
    nanoGPT's ``estimate_loss``; the batches are the same at every call."""
    model.eval()
    try:
        rng = eval_rng(cfg.seed)
        out = {}
        for name in ("train", "val"):
            losses = [model.loss(*dataset.batch(name, cfg.batch_size, cfg.block_size, rng)) for _ in range(cfg.eval_iters)]
            out[name] = float(np.mean(losses))
        return out
    finally:
        model.train()


class Diverged(RuntimeError):
    """The run's numbers stopped being finite: a batch loss, the gradients, an evaluation or the
    weights. ``step`` is the update that failed (1-based, as the log counts) and ``what`` says
    which number; the run is left unsaved there, so the folder keeps its last good checkpoint."""

    def __init__(self, step: int, what: str, cfg: TrainConfig):
        self.step, self.what = step, what
        super().__init__(f"the run diverged at step {step}: {what}. A lower learning rate (this run's peak: "
                         f"lr = {cfg.lr:g}) or more warm-up steps (warmup = {cfg.warmup}) usually keeps it finite")

    def __reduce__(self):  # across processes (a worker's model): message and attributes, not __init__'s arguments
        return (_diverged, (str(self), dict(self.__dict__)))


def _diverged(message: str, attrs: dict) -> Diverged:
    err = Diverged.__new__(Diverged)
    RuntimeError.__init__(err, message)
    err.__dict__.update(attrs)
    return err


def _refused(run: Run, x, y, err: ShapeError, step: int, where: str) -> Diverged | None:
    """The Diverged that a layer's refusal of its input (``err``, at the batch ``x, y``) stands
    for, or None where it is an error of the settings.

    A recurrent mixer checks the numbers the weights make (a log decay must be finite and <= 0):
    weights that blew up make it refuse, by a ShapeError, where attention's loss would go NaN.
    That is divergence once the run has updated its weights and the same batch goes through a
    model of the same config at its initial weights (the settings are fine; the weights are not),
    or the weights are not finite; otherwise the refusal stays the settings' error."""
    if run.step == 0:
        return None
    bad = [name for name, p in run.model.params.items() if not np.isfinite(p).all()]
    if not bad:
        from ..models.gpt import GPT

        try:
            GPT(run.model.config).loss(x, y)  # the settings on this batch, at the initial weights
        except ShapeError:
            return None
        except Exception:  # noqa: BLE001 - no model to compare with (a wrapper): the shapes decide
            if np.shape(x) not in run.shapes:
                return None
    cause = f"the weights are not finite ({', '.join(bad[:3])})" if bad else "the weights grew out of range"
    return Diverged(step, f"{where} failed: {cause}, and a layer refused what they made: {err}", run.cfg)


def refusal_as_divergence(run: Run, x, y, err: ShapeError, where: str) -> Diverged | None:
    """:func:`_refused` for a caller outside the training step (an experiment's evaluation): the
    Diverged a layer's refusal of the batch ``x, y`` stands for at the run's step, or None."""
    return _refused(run, x, y, err, run.step, where)


def _micro_step(run: Run, x: np.ndarray, y: np.ndarray) -> float:
    """The loss of one (micro-)batch and its gradient in ``model.grads``; Diverged if the loss is not
    finite (or a layer refuses the numbers the updated weights made: :func:`_refused`)."""
    try:
        loss = float(run.model.loss(x, y))
    except ShapeError as err:
        diverged = _refused(run, x, y, err, run.step + 1, "the batch's forward")
        if diverged is None:
            raise
        raise diverged from None
    run.shapes.add(np.shape(x))
    if not math.isfinite(loss):
        raise Diverged(run.step + 1, f"the batch loss is {loss}", run.cfg)
    run.model.backward()
    return loss


def train_step(run: Run, x: np.ndarray, y: np.ndarray) -> float:
    """One update from the batch ``x, y (B, T)``; returns the batch's loss (before the update).

    ``x, y (N, B, T)`` are ``N`` micro-batches (gradient accumulation): each one's gradient is
    added up and the update takes their mean, which is the gradient of the ``N·B``-row batch
    (nanoGPT divides each micro-batch's loss by ``N`` before its backward: the same sum); the
    loss returned is the micro-batches' mean, the ``N·B``-row batch's loss.

    A non-finite loss or gradient raises :class:`Diverged` before the update: the weights and
    AdamW's moments are those of the step before."""
    lr = lr_at(run.step, run.cfg)
    if np.ndim(x) == 2:
        loss = _micro_step(run, x, y)
    else:
        losses, total = [], None
        for xi, yi in zip(x, y):
            losses.append(_micro_step(run, xi, yi))
            if total is None:
                total = {k: g.copy() for k, g in run.model.grads.items()}
            else:
                for k, g in run.model.grads.items():
                    total[k] += g
        for k, g in run.model.grads.items():
            np.multiply(total[k], 1.0 / len(losses), out=g)         # the mean of the micro-batches' gradients
        loss = float(np.mean(losses))
    norm = run.opt.grad_norm()
    if not math.isfinite(norm):
        bad = [name for name, g in run.model.grads.items() if not np.isfinite(g).all()]
        raise Diverged(run.step + 1, f"the gradients are not finite ({', '.join(bad[:3])}"
                       f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}; the batch loss was {loss:.4g})",
                       run.cfg)
    run.opt.step(lr)
    run.step += 1
    run.log["losses"].append(loss)
    return loss


def next_batch(run: Run, dataset: TokenDataset):
    """The next step's batch from the run's stream: ``(B, T)`` each, or ``(N, B, T)`` with
    ``grad_accum = N`` (the micro-batches drawn one after another, as nanoGPT draws them)."""
    c = run.cfg
    if c.grad_accum == 1:
        return dataset.batch("train", c.batch_size, c.block_size, run.rng)
    pairs = [dataset.batch("train", c.batch_size, c.block_size, run.rng) for _ in range(c.grad_accum)]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def check_finite(run: Run) -> None:
    """Raise :class:`Diverged` unless the run's weights and its latest evaluation are finite:
    asked before every checkpoint, so a saved run is always one that can continue."""
    bad = [name for name, p in run.model.params.items() if not np.isfinite(p).all()]
    if bad:
        raise Diverged(run.step, f"the weights are not finite after the update ({', '.join(bad[:3])})", run.cfg)
    last = run.log["evals"][-1] if run.log["evals"] else None
    if last is not None and not (math.isfinite(last["train_loss"]) and math.isfinite(last["val_loss"])):
        raise Diverged(run.step, f"the evaluation's losses are train {last['train_loss']}, val {last['val_loss']}",
                       run.cfg)


def _log_eval(run: Run, dataset: TokenDataset) -> dict:
    try:
        ev = evaluate(run.model, dataset, run.cfg)
    except ShapeError as err:
        x, y = dataset.batch("val", run.cfg.batch_size, run.cfg.block_size, eval_rng(run.cfg.seed))
        diverged = _refused(run, x, y, err, run.step, "the evaluation")
        if diverged is None:
            raise
        raise diverged from None
    run.shapes.add((run.cfg.batch_size, run.cfg.block_size))
    entry = {"step": run.step, "train_loss": ev["train"], "val_loss": ev["val"],
             "lr": lr_at(run.step - 1, run.cfg) if run.step else None,  # of the last update
             "seconds": round(run.seconds, 3)}
    run.log["evals"].append(entry)
    return entry


def train(run: Run, dataset: TokenDataset, *, checkpoint=None, progress=None, stop=None, log=None) -> str:
    """Advance ``run`` to ``run.cfg.steps``; returns ``"done"`` or ``"stopped"``.

    Evaluates at step 0 (a fresh run), every ``eval_interval`` steps and at the last step,
    and calls ``checkpoint(run)`` after each of those evaluations (the CLI saves the run
    there). ``progress(step, loss, val_loss, tokens_per_s)`` follows every step (``val_loss``:
    the latest evaluation's, None before one; the rate a running mean). ``log(entry)`` gets
    every step's ``{"step", "loss", "ms", "tokens_per_s"}`` (that step's own time) and every
    evaluation's entry of ``run.log["evals"]``. ``stop()`` is asked after every step; when it
    says True the run is checkpointed at that step and ``"stopped"`` is returned. With
    ``cfg.keep_best`` an evaluation is checkpointed only when its val loss is below every earlier
    one's (step 0's aside), and a stop checkpoints nothing: the best checkpoint stays.

    A run whose loss, gradients, evaluation or weights stop being finite raises
    :class:`Diverged` before anything of it is checkpointed: the last checkpoint stays the
    last good one."""
    cfg = run.cfg
    check_data(cfg, dataset)
    progress = progress or (lambda *a: None)
    log = log or (lambda entry: None)
    tokens = cfg.batch_size * cfg.block_size * cfg.grad_accum
    if run.step == 0 and not run.log["evals"]:
        t0 = time.perf_counter()
        log(_log_eval(run, dataset))
        run.seconds += time.perf_counter() - t0
    val = run.log["evals"][-1]["val_loss"] if run.log["evals"] else None
    rate = None
    while run.step < cfg.steps:
        t0 = time.perf_counter()
        loss = train_step(run, *next_batch(run, dataset))
        dt = time.perf_counter() - t0
        rate = tokens / dt if rate is None else 0.9 * rate + 0.1 * tokens / dt  # a running mean for the bar
        log({"step": run.step, "loss": loss, "ms": 1e3 * dt, "tokens_per_s": tokens / dt})
        evaluated = run.step % cfg.eval_interval == 0 or run.step == cfg.steps
        if evaluated:
            entry = _log_eval(run, dataset)
            val = entry["val_loss"]
            log(entry)
        run.seconds += time.perf_counter() - t0
        progress(run.step, loss, val, rate)
        if stop is not None and stop() and run.step < cfg.steps:
            if checkpoint and not cfg.keep_best:  # keep_best: the best evaluation's checkpoint stays
                check_finite(run)
                checkpoint(run)
            return "stopped"
        if evaluated and checkpoint and (not cfg.keep_best or best_val(run.log, last=True)):
            check_finite(run)
            checkpoint(run)
    return "done"


def best_val(log: dict, last: bool = False):
    """The lowest val loss of the log's evaluations after step 0 (None if none); ``last``: whether
    the latest evaluation is the best so far (nanoGPT's ``losses['val'] < best_val_loss``)."""
    vals = [e["val_loss"] for e in log["evals"] if e["step"] > 0]
    if last:
        return bool(vals) and all(vals[-1] < v for v in vals[:-1])
    return min(vals) if vals else None


def plot_log(log: dict, path, title: str = "qkv train gpt") -> None:
    """Batch loss per step (faint), and each evaluation's train and val loss."""
    from ..extras import figure

    fig = figure(figsize=(6.5, 3.8))
    ax = fig.subplots()
    losses = np.asarray(log["losses"], dtype=float)
    if len(losses):
        ax.plot(np.arange(1, len(losses) + 1), losses, lw=0.6, alpha=0.35, label="batch loss")
    evals = log["evals"]
    if evals:
        steps = [e["step"] for e in evals]
        ax.plot(steps, [e["train_loss"] for e in evals], "o-", ms=3, label="train (eval)")
        ax.plot(steps, [e["val_loss"] for e in evals], "o-", ms=3, label="val (eval)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_title(title)
    ax.legend()
    path = Path(path)
    tmp = path.with_name(f".{path.name}")  # drawn beside, then moved: the old picture or the new one, never half
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    os.replace(tmp, path)
