"""``qkv experiment mqar``: which token mixers recall many keys at once (Zoology's MQAR).

Zoology (Arora et al., 2023, arXiv:2312.04927) trains 2-layer models on multi-query
associative recall (:mod:`qkv.experiments.mqar_data`: pairs, then queries of their keys,
answered by their values) and finds: attention solves it at every model width; gated
convolutions and linear recurrences need a width that grows with the number of pairs (their
state must hold every pair); hybrids with one attention layer close most of the gap.

Here the same on qkv's GPT (:class:`qkv.models.GPT`, ``GPTConfig(layers=...)``): for each
mixer (``attention``, ``linear``, ``mamba2``, ``gated_delta``, ``rglru``, and the hybrids
``attention+X``: an X layer then an attention layer) and each width ``n_embd``, one 2-layer
model trained on a mixture of the pair counts at ``T = seq_len`` (as Zoology trains one model
on its mixture of (T, pairs)), then its accuracy at the query positions of held-out
sequences of each pair count. Training is ``qkv train gpt``'s step
(:func:`qkv.models.training.train_step`: AdamW, clipping at norm 1, warm-up then cosine,
float32), with the loss at the query positions only (targets ``-1`` elsewhere).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from ..errors import ShapeError, positive_int
from .mqar_data import check_task, mqar_batch, query_accuracy

MIXERS = ("attention", "linear", "mamba2", "gated_delta", "rglru")
RECURRENT = MIXERS[1:]
HYBRIDS = tuple(f"attention+{m}" for m in RECURRENT)


@dataclass
class MQARConfig:
    """Settings of ``qkv experiment mqar`` (the defaults are the full grid; see :meth:`quick`).

    Zoology's: vocabulary 8192, 100 000 training sequences (64 epochs), lr swept in
    [1e-4, 1e-2], widths 64 … 512, T up to 512. Here, for a CPU: vocabulary 512 (keys and
    values 255 each, > T as Zoology asks), 300 steps of 16 fresh sequences, lr 3e-3.
    """

    mixers: tuple = MIXERS + HYBRIDS
    widths: tuple = (32, 64, 128)
    pairs: tuple = (4, 8, 16, 32, 64)
    seq_len: int = 256
    vocab_size: int = 512
    n_head: int = 1
    steps: int = 300
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 40
    weight_decay: float = 0.1
    n_eval: int = 64
    seed: int = 0

    @classmethod
    def quick(cls) -> "MQARConfig":
        """Under 3 minutes on 2 cores (with the chunked recurrent kernels): attention, Mamba-2 and
        their hybrid, width 64, 4 and 16 pairs at T = 128."""
        return cls(mixers=("attention", "mamba2", "attention+mamba2"), widths=(64,), pairs=(4, 16),
                   seq_len=128, steps=200, batch=16, warmup=20, n_eval=32)

    def check(self) -> None:
        if not self.mixers or not self.widths or not self.pairs:
            raise ShapeError("mixers, widths and pairs must each name at least one value; got "
                             f"{len(self.mixers)}, {len(self.widths)} and {len(self.pairs)}")
        for m in self.mixers:
            layers(m)
        for name in ("n_head", "steps", "batch", "n_eval"):
            positive_int(name, getattr(self, name))
        for w in self.widths:
            if positive_int("widths", w) % self.n_head:
                raise ShapeError(f"widths must be multiples of n_head = {self.n_head}; got {w}")
        for p in self.pairs:
            check_task(p, self.seq_len, self.vocab_size)
        self.train_config(self.mixers[0], self.widths[0]).check()

    def train_config(self, mixer: str, width: int):
        """The :class:`qkv.models.trainconfig.TrainConfig` of one (mixer, width) model."""
        from ..models.trainconfig import TrainConfig

        return TrainConfig(block_size=self.seq_len, batch_size=self.batch, n_layer=2, n_head=self.n_head,
                           n_embd=int(width), lr=self.lr, warmup=self.warmup, steps=self.steps,
                           weight_decay=self.weight_decay, seed=self.seed, vocab_size=self.vocab_size,
                           layers=layers(mixer))

    @property
    def n_steps(self) -> int:
        """Training steps in all (``progress`` is called after each)."""
        return len(self.mixers) * len(self.widths) * self.steps


def layers(mixer: str) -> str:
    """``GPTConfig.layers`` of a 2-layer model: ``"mamba2"`` -> ``"mamba2,mamba2"``; a hybrid
    ``"attention+mamba2"`` -> ``"mamba2,attention"``: the recurrent layer first, as every pattern
    of :mod:`qkv.models.hybrid` places attention after recurrent layers (Jamba, Qwen3-Next, Griffin)."""
    parts = mixer.split("+") if isinstance(mixer, str) else [None]
    if len(parts) == 1 and parts[0] in MIXERS:
        return f"{parts[0]},{parts[0]}"
    if len(parts) == 2 and parts[0] == "attention" and parts[1] in RECURRENT:
        return f"{parts[1]},attention"
    raise ShapeError(f"mixers must be among {list(MIXERS)} or a hybrid {list(HYBRIDS)}; got {mixer!r}")


def mixture(rng: np.random.Generator, batch: int, pairs, seq_len: int, vocab_size: int) -> tuple:
    """A training batch ``(inputs, targets)`` ``(batch, T)`` whose rows share out the pair counts
    (``batch // len(pairs)`` rows each, the first counts one more until ``batch`` is reached)."""
    sizes = [batch // len(pairs) + (i < batch % len(pairs)) for i in range(len(pairs))]
    parts = [mqar_batch(rng, n, p, seq_len, vocab_size) for n, p in zip(sizes, pairs) if n]
    return (np.concatenate([d["inputs"] for d in parts]), np.concatenate([d["targets"] for d in parts]))


def evaluate(model, cfg: MQARConfig, chunk: int = 16) -> list[float]:
    """Accuracy at the query positions of ``n_eval`` held-out sequences of each pair count (the
    same sequences for every model: a Generator made afresh from the seed)."""
    rng = np.random.default_rng((2, cfg.seed))
    model.eval()
    try:
        out = []
        for p in cfg.pairs:
            d = mqar_batch(rng, cfg.n_eval, p, cfg.seq_len, cfg.vocab_size)
            hits = 0.0
            for i in range(0, cfg.n_eval, chunk):
                t = d["targets"][i:i + chunk]
                hits += query_accuracy(model.forward(d["inputs"][i:i + chunk]), t) * np.count_nonzero(t != -1)
            out.append(float(hits / np.count_nonzero(d["targets"] != -1)))
        return out
    finally:
        model.train()


def train_one(cfg: MQARConfig, mixer: str, width: int, progress=None) -> dict:
    """Train one (mixer, width) model on the mixture; returns ``{"accuracy": [per pair count],
    "final_loss", "seconds", "params"}``. ``progress()`` is called after every step."""
    from ..models.training import Run, gpt_config, make_optimizer, train_step
    from ..models import GPT

    tc = cfg.train_config(mixer, width).resolved()
    model = GPT(gpt_config(tc, cfg.vocab_size))
    run = Run(tc, model, make_optimizer(model, tc), np.random.default_rng((1, cfg.seed)), None, {"kind": "mqar"})
    start, losses = time.perf_counter(), []
    with threadpool_limits(limits=1, user_api="blas"):  # small products: a second BLAS thread only waits
        for _ in range(cfg.steps):
            x, y = mixture(run.rng, cfg.batch, cfg.pairs, cfg.seq_len, cfg.vocab_size)
            losses.append(train_step(run, x, y))
            if progress is not None:
                progress()
        seconds = time.perf_counter() - start
        accuracy = evaluate(model, cfg)
    return {"accuracy": accuracy, "final_loss": float(np.mean(losses[-20:])), "seconds": round(seconds, 2),
            "params": model.num_params()}


def mqar_experiment(cfg: MQARConfig | None = None, progress=None) -> dict:
    """Train every (mixer, width) model; returns the record written as ``mqar.json``.

    ``rows``: one ``{mixer, width, pairs, accuracy}`` per (mixer, width, pair count);
    ``runs``: one ``{mixer, width, final_loss, seconds, params}`` per model; ``chance``
    (1 / values); ``config``. ``progress(done, total)`` is called after every training step.
    """
    cfg = cfg or MQARConfig()
    cfg.check()
    done = 0

    def step():
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, cfg.n_steps)

    rows, runs = [], []
    for mixer in cfg.mixers:
        for width in cfg.widths:
            r = train_one(cfg, mixer, width, step)
            rows += [{"mixer": mixer, "width": int(width), "pairs": int(p), "accuracy": a}
                     for p, a in zip(cfg.pairs, r["accuracy"])]
            runs.append({"mixer": mixer, "width": int(width), "final_loss": r["final_loss"],
                         "seconds": r["seconds"], "params": r["params"]})
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}
    return {"rows": rows, "runs": runs, "chance": 1.0 / (cfg.vocab_size - cfg.vocab_size // 2), "config": config}
