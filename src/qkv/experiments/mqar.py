"""``qkv experiment mqar``: which token mixers recall many keys at once (Zoology's MQAR).

Zoology (Arora et al., 2023, arXiv:2312.04927) trains 2-layer models on multi-query
associative recall (:mod:`qkv.experiments.mqar_data`: pairs, then queries of their keys,
answered by their values) and finds: attention solves it at every model width; gated
convolutions and linear recurrences need a width that grows with the number of pairs (their
state must hold every pair); hybrids with attention close the gap.

Here the same on qkv's GPT (:class:`qkv.models.GPT`, ``GPTConfig(layers=...)``), built as
Zoology's 2024 MQAR models (:func:`layers`): a BaseConv layer, then the mixer under test
(``attention``: plain multi-head attention; ``linear``: elu+1 linear attention; ``based``:
Based's Taylor linear attention; ``mamba2`` with expand 2; ``gated_delta`` with expand_v 2;
``rglru``; and the hybrids ``attention+X``: BaseConv, attention, then X). Every model has the
same budget of steps and is trained with Zoology's recipe (:meth:`MQARConfig.train_config`:
AdamW, weight decay 0.1, betas (0.9, 0.999), cosine to 0 without warm-up, no clipping), stops
once its accuracy on a held-out validation set exceeds ``stop_accuracy`` (0.99, Zoology's
rule), and is then scored on a test set of each pair count at ``T = seq_len``. The sweep of
learning rates, the seeds and the spreading of runs over processes or MPI ranks are in
:mod:`qkv.experiments.mqar_runs`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from ..errors import ShapeError, positive_int
from .mqar_data import FILLERS, VOCAB, check_task, mqar_batch

MIXERS = ("attention", "linear", "based", "mamba2", "gated_delta", "rglru")
RECURRENT = MIXERS[1:]
HYBRIDS = tuple(f"attention+{m}" for m in RECURRENT)
LAYER = {"attention": "attention", "linear": "linear", "based": "based", "mamba2": "mamba2:expand=2",
         "gated_delta": "gated_delta:expand_v=2", "rglru": "rglru"}
"""Each mixer's ``GPTConfig.layers`` token: Zoology's state sizes (Mamba-2's expand 2, Gated
DeltaNet's expand_v 2; Based's 16 features a head)."""


@dataclass
class MQARConfig:
    """Settings of ``qkv experiment mqar`` (the defaults are the full grid; see :meth:`quick`).

    Zoology's: vocabulary 8192, 4 pairs at T = 64 up to 64 pairs at T = 256, 5.8-11.5 M training
    sequences, widths 64 … 512, 4 learning rates a model. Here, sized for a CPU: the tasks
    ``pairs`` at ``T = min(seq_len, 16 · pairs)`` (:meth:`tasks`, one task a step in the order of
    :meth:`schedule`), ``steps`` steps of ``batch`` fresh sequences for every model, each
    (mixer, width) at every learning rate of ``lrs`` for ``seeds[0]``, the best on validation
    then trained again for the other seeds. ``val_every``: steps between validations (the stop
    rule's); ``n_val`` validation sequences a task (Generator ``(3, seed)``), ``n_eval`` test
    sequences a pair count at ``seq_len`` (Generator ``(2, seed)``), never used to choose.
    ``baseconv``: the taps of the BaseConv layer before the mixer (0: none, the mixer alone).
    ``workers``: runs at once, a process of one thread each (the same bits as one process).
    ``model``: ``"zoology"`` (:func:`zoology_model`, Zoology's ``LanguageModel`` and each mixer as its
    ``models_repo.py`` builds it; ``n_head``, ``positions`` are then the linear attention's and
    RG-LRU's heads only, mixers Zoology does not build) or ``"gpt"`` (:meth:`model_config`, qkv's GPT
    with its MLP and RoPE, the grids recorded before issue 60). ``embed_dropout``,
    ``attention_dropout``: Zoology's 0.1 (``ModelConfig.embed_dropout``, ``MHA(dropout=0.1)``).
    """

    mixers: tuple = MIXERS + HYBRIDS
    widths: tuple = (32, 64)
    pairs: tuple = (4, 8, 16)
    seq_len: int = 128
    vocab_size: int = VOCAB
    filler: str = "random"
    n_head: int = 2
    positions: str = "rope"
    steps: int = 1000
    batch: int = 32
    lrs: tuple = (1e-3, 3e-3, 1e-2)
    seeds: tuple = (0, 1, 2)
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.999)
    grad_clip: float = 0.0
    stop_accuracy: float = 0.99
    val_every: int = 100
    n_val: int = 64
    n_eval: int = 64
    baseconv: int = 3
    workers: int = 1
    model: str = "zoology"
    embed_dropout: float = 0.1
    attention_dropout: float = 0.1

    @classmethod
    def quick(cls) -> "MQARConfig":
        """Under 3 minutes of CPU: attention against Mamba-2 (Zoology's, 1 head of 64 at width 32) at width 32,
        4 pairs at T = 64. (Gated DeltaNet built as Zoology builds it recalls there: 0.93 after 600 steps.)"""
        return cls(mixers=("attention", "mamba2"), widths=(32,), pairs=(4,), seq_len=64, steps=600,
                   batch=32, lrs=(1e-2,), seeds=(0,), val_every=50, n_val=32, n_eval=64)

    def tasks(self) -> list[tuple[int, int]]:
        """``(pairs, T)`` of each training task: Zoology's lengths, ``T = 16 · pairs``, at most ``seq_len``."""
        return [(int(p), min(self.seq_len, 16 * int(p))) for p in self.pairs]

    def schedule(self, step: int) -> tuple[int, int]:
        """The task of training step ``step``: the fewest pairs every other step, the others in turn
        between them (4, 8, 4, 16, 4, 8, ...: Zoology's mixture leans on its smallest task)."""
        tasks = self.tasks()
        cycle = [0] + [j for i in range(1, len(tasks)) for j in (i, 0)]
        return tasks[cycle[step % len(cycle)]]

    def check(self, available=None) -> None:
        """A ShapeError for a setting no model can train with (an unknown or repeated mixer, width,
        pair count, lr or seed; a task the vocabulary cannot hold; a widest model that needs more
        memory than the machine has ``available``)."""
        if self.model not in ("zoology", "gpt"):
            raise ShapeError(f"model must be 'zoology' or 'gpt'; got {self.model!r}")
        for name in ("embed_dropout", "attention_dropout"):
            p = getattr(self, name)
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
                raise ShapeError(f"{name} must be a probability in [0, 1); got {p!r}")
        for name in ("mixers", "widths", "pairs", "lrs", "seeds"):
            values = list(getattr(self, name))
            if not values:
                raise ShapeError(f"{name} must name at least one value; got none")
            twice = sorted({str(v) for v in values if values.count(v) > 1})
            if twice:
                raise ShapeError(f"{name} must name each value once; got {', '.join(twice)} more than once")
        for m in self.mixers:
            layers(m)
        if self.filler not in FILLERS:
            raise ShapeError(f"filler must be one of {list(FILLERS)}; got {self.filler!r}")
        for lr in self.lrs:
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
                raise ShapeError(f"lrs must be finite numbers > 0; got {lr!r}")
        if not (isinstance(self.stop_accuracy, (int, float)) and 0 < self.stop_accuracy <= 1.5):
            raise ShapeError(f"stop_accuracy must be a number in (0, 1] (above 1: never stop); got {self.stop_accuracy!r}")
        for name in ("n_head", "steps", "batch", "n_eval", "n_val", "workers", "val_every"):
            positive_int(name, getattr(self, name))
        positive_int("baseconv", self.baseconv, 0)
        for s in self.seeds:
            positive_int("seeds", s, 0)
        for w in self.widths:
            if positive_int("widths", w) % self.n_head:
                raise ShapeError(f"widths must be multiples of n_head = {self.n_head}; got {w}")
            if self.model == "zoology" and any("mamba2" in m for m in self.mixers) and (2 * w) % MAMBA2_HEADDIM:
                raise ShapeError(f"widths must make Zoology's Mamba-2 inner width 2·w a multiple of its head "
                                 f"width {MAMBA2_HEADDIM}; got {w}")
        for p, t in self.tasks():
            check_task(p, t, self.vocab_size)
            check_task(p, self.seq_len, self.vocab_size)
        for m in self.mixers:
            self.train_config(m, self.widths[0], self.lrs[0], self.seeds[0]).check()
        from ..training.memory import check_fits

        check_fits(self.train_config(self.mixers[0], max(self.widths), self.lrs[0], 0), self.vocab_size,
                   {"n_embd": "widths", "batch_size": "batch", "block_size": "seq_len", "n_layer": None}, available)

    def model_config(self, mixer: str, width: int, seed: int):
        """The :class:`qkv.models.GPTConfig` of one (mixer, width) model, its weights from ``seed``."""
        from ..models import GPTConfig

        pattern = layers(mixer, self.baseconv)
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.seq_len, n_layer=pattern.count(",") + 1,
                         n_head=self.n_head, n_embd=int(width), positions=self.positions, seed=int(seed),
                         layers=pattern)

    def train_config(self, mixer: str, width: int, lr: float, seed: int):
        """The :class:`qkv.training.config.TrainConfig` of one run: Zoology's optimizer and
        schedule (AdamW over every matrix, the embeddings too; cosine from ``lr`` to 0 over
        ``steps``, no warm-up; no clipping for ``grad_clip = 0``)."""
        from ..training.config import TrainConfig

        pattern = layers(mixer, self.baseconv)
        return TrainConfig(block_size=self.seq_len, batch_size=self.batch, n_layer=pattern.count(",") + 1,
                           n_head=self.n_head, n_embd=int(width), lr=float(lr), min_lr=0.0, warmup=0,
                           steps=self.steps, weight_decay=self.weight_decay, beta1=self.betas[0],
                           beta2=self.betas[1], grad_clip=self.grad_clip, decay_embeddings=True, seed=int(seed),
                           vocab_size=self.vocab_size, layers=pattern)

    def runs(self) -> int:
        """Training runs of the grid: every lr for the first seed, the chosen lr for the others."""
        return len(self.mixers) * len(self.widths) * (len(self.lrs) + len(self.seeds) - 1)


def layers(mixer: str, baseconv: int = 3) -> str:
    """``GPTConfig.layers`` of one model: ``"mamba2"`` -> ``"baseconv,mamba2:expand=2"`` (a BaseConv
    layer, then the mixer: Zoology's 2024 MQAR models); a hybrid ``"attention+mamba2"`` ->
    ``"baseconv,attention,mamba2:expand=2"``. ``baseconv = 0``: no BaseConv layer (``"attention"``
    -> ``"attention"``); ``baseconv = K``: ``baseconv:kernel=K`` for ``K != 3``.

    The attention of a hybrid comes before its recurrence: with the recurrent layer first its
    output swamped the embeddings in the residual stream and no hybrid learned (an earlier
    grid: accuracy 0.03 against 0.58 attention first)."""
    parts = mixer.split("+") if isinstance(mixer, str) else [None]
    conv = [] if not baseconv else ["baseconv" if baseconv == 3 else f"baseconv:kernel={baseconv}"]
    if len(parts) == 1 and parts[0] in MIXERS:
        return ",".join(conv + [LAYER[parts[0]]])
    if len(parts) == 2 and parts[0] == "attention" and parts[1] in RECURRENT:
        return ",".join(conv + ["attention", LAYER[parts[1]]])
    raise ShapeError(f"mixers must be among {list(MIXERS)} or a hybrid {list(HYBRIDS)}; got {mixer!r}")


def accuracy(model, batches, chunk: int = 16) -> float:
    """The fraction of query positions answered right over ``batches`` (a list of
    :func:`~qkv.experiments.mqar_data.mqar_batch` dicts); the head only at the queries."""
    hits = total = 0
    for d in batches:
        for i in range(0, len(d["inputs"]), chunk):
            t = d["targets"][i:i + chunk]
            keep = t != -1
            hits += int(np.count_nonzero(np.argmax(model.logits_at(d["inputs"][i:i + chunk], keep), -1) == t[keep]))
            total += int(np.count_nonzero(keep))
    return hits / total


def held_out(cfg: MQARConfig, seed: int) -> tuple[list, list]:
    """``(validation, test)``: ``n_val`` sequences of each training task (Generator ``(3, seed)``),
    and ``n_eval`` of each pair count at ``T = seq_len`` (Generator ``(2, seed)``)."""
    rv, rt = np.random.default_rng((3, seed)), np.random.default_rng((2, seed))
    val = [mqar_batch(rv, cfg.n_val, p, t, cfg.vocab_size, filler=cfg.filler) for p, t in cfg.tasks()]
    test = [mqar_batch(rt, cfg.n_eval, p, cfg.seq_len, cfg.vocab_size, filler=cfg.filler) for p in cfg.pairs]
    return val, test


def train_one(cfg: MQARConfig, mixer: str, width: int, lr: float, seed: int, progress=None) -> dict:
    """Train one model; returns ``{"accuracy": [test, per pair count], "val_accuracy", "final_loss",
    "seconds", "params", "steps", "diverged"}``. It stops at the first validation (every
    ``val_every`` steps and at the end) whose accuracy exceeds ``stop_accuracy``. A run whose
    numbers stop being finite ends there (``diverged``: True; its accuracies are those of its
    last finite weights' evaluation: 0 before any). ``progress()`` after every step (and once for
    each step an early stop left out). On one thread: the same bits in any process."""
    from ..models import GPT
    from ..errors import ShapeError
    from ..training.loop import Diverged, Run, make_optimizer, refusal_as_divergence, train_step
    from ..threads import kernel_threads

    tc = cfg.train_config(mixer, width, lr, seed).resolved()
    model = zoology_model(cfg, mixer, width, seed) if cfg.model == "zoology" else GPT(cfg.model_config(mixer, width, seed))
    run = Run(tc, model, make_optimizer(model, tc), np.random.default_rng((1, seed)), None, {"kind": "mqar"})
    val, test = held_out(cfg, seed)
    start, losses, val_acc, diverged = time.perf_counter(), [], 0.0, None
    with threadpool_limits(limits=1, user_api="blas"), kernel_threads(1):
        for step in range(cfg.steps):
            pairs, t = cfg.schedule(step)
            d = mqar_batch(run.rng, cfg.batch, pairs, t, cfg.vocab_size, filler=cfg.filler)
            try:
                losses.append(train_step(run, d["inputs"], d["targets"]))
            except Diverged as err:
                diverged = err
                break
            if progress is not None:
                progress()
            if (step + 1) % cfg.val_every == 0 or step + 1 == cfg.steps:
                model.eval()
                try:
                    val_acc = accuracy(model, val)
                except ShapeError as err:   # a recurrent layer refused what blown-up weights made
                    cause = refusal_as_divergence(run, val[0]["inputs"], val[0]["targets"], err, "an evaluation")
                    if cause is None:
                        raise
                    diverged, val_acc = cause, 0.0
                    break
                model.train()
                if val_acc > cfg.stop_accuracy:
                    break
        seconds = time.perf_counter() - start
        for _ in range(cfg.steps - len(losses) if progress is not None else 0):
            progress()
        model.eval()
        test_acc = [0.0] * len(test) if diverged else [accuracy(model, [d]) for d in test]
    return {"accuracy": test_acc, "val_accuracy": float(val_acc), "diverged": bool(diverged),
            "diverged_at": str(diverged) if diverged else None,
            "final_loss": float(np.mean(losses[-20:])) if losses else float("nan"), "seconds": round(seconds, 2),
            "params": model.num_params(), "steps": len(losses)}


MAMBA2_HEADDIM = 64   # zoology.mixers.mamba2.Mamba2's headdim (expand 2: 2·width / 64 heads)


def zoology_mixers(cfg: MQARConfig, mixer: str) -> tuple[str, list[str]]:
    """``(block, kinds)``: Zoology's block type and each layer's mixer for ``mixer``. Zoology's
    ``Hybrid([BaseConv, X])`` over 2 layers is BaseConv at layer 0 and X at layer 1; its Mamba-2 is
    ``Mamba2Block`` x 2 without BaseConv (``add_mamba2`` ignores ``conv_mixer``). A hybrid
    ``attention+X`` (not a Zoology model) is BaseConv, attention, X in Zoology's blocks."""
    layers(mixer, cfg.baseconv)   # the name check
    if mixer == "mamba2":
        return "mamba2", ["mamba2", "mamba2"]
    return "transformer", (["baseconv"] if cfg.baseconv else []) + mixer.split("+")


def _make(cfg: MQARConfig, kind: str, d: int, rng, dtype):
    """One mixer as ``zoology/experiments/models_repo.py`` passes it (its kwargs, then Zoology's init)."""
    from ..nn import BasedAttention, ConvMixer, GatedDeltaNet, LinearAttention, Mamba2, MultiHeadAttention, RGLRU

    kw = dict(dtype=dtype, rng=rng)
    if kind == "baseconv":      # BaseConv(kernel_size=3): Linear(d, d) with bias, Conv1d(d, d, 3, groups=d)
        return ConvMixer(d, cfg.baseconv, **kw)
    if kind == "attention":     # MHA(num_heads=1, bias=True, dropout=0.1), no positions
        return MultiHeadAttention(d, 1, causal=True, bias=True, rope=False, dropout=cfg.attention_dropout, **kw)
    if kind == "based":         # Based(feature_dim=16 of 8/16/24, num_heads=1, num_key_value_heads=1, taylor_exp)
        return BasedAttention(d, 1, 16, **kw)
    if kind == "gated_delta":   # GatedDeltaNet(num_heads=2, use_gate=False, conv_size=4, expand_v=2, norm_eps=1e-5)
        return GatedDeltaNet(d, 2, 2, d // 2, d, conv_kernel=4, eps=1e-5, use_gate=False, **kw)
    if kind == "mamba2":        # Mamba2(d_state=16 of 8/16/24, headdim=64, expand=2, d_conv=4, conv_bias, no bias)
        return Mamba2(d, 2 * d // MAMBA2_HEADDIM, MAMBA2_HEADDIM, 16, conv_kernel=4, bias=False, conv_bias=True,
                      eps=1e-5, **kw)
    if kind == "rglru":         # not in Zoology: qkv's GPT settings
        return RGLRU(d, d, cfg.n_head, conv_width=4, **kw)
    return LinearAttention(d, cfg.n_head, causal=True, bias=True, **kw)   # not in Zoology: qkv's elu+1


def _zoology_init(kind: str, layer, rng, n_layers: int) -> None:
    """Zoology's ``_init_weights`` (every ``nn.Linear`` normal(0, 0.02), bias 0; ``out_proj.weight``
    normal(0, 0.02 / sqrt(2 n_layers))) and each mixer's own draws of what is not a Linear."""
    p = layer.params
    out = 0.02 / math.sqrt(2 * n_layers)
    for name, a in p.items():
        if name.startswith("W_") or name in ("W_in", "W_out"):
            std = out if (kind in ("attention", "mamba2", "linear", "rglru") and name in ("W_O", "W_out")) else 0.02
            a[...] = rng.standard_normal(a.shape) * std
        elif name.startswith("b_"):
            a[...] = 0
    bound = 1 / math.sqrt(p["conv_weight"].shape[1]) if "conv_weight" in p else None
    if kind in ("gated_delta", "mamba2"):   # torch Conv1d's default: uniform(±1/sqrt(K)), its bias too
        for name in ("conv_weight", "conv_bias"):
            if name in p:
                p[name][...] = rng.uniform(-bound, bound, p[name].shape)
        lo = 0.0 if kind == "gated_delta" else 1.0   # A ~ U(0, 16) (GatedDeltaNet), U(1, 16) (A_init_range)
        p["A_log"][...] = np.log(rng.uniform(lo, 16.0, p["A_log"].shape))


def zoology_model(cfg: MQARConfig, mixer: str, width: int, seed: int, dtype=np.float32):
    """The :class:`qkv.models.zoology.ZoologyLM` of one (mixer, width), its weights from ``seed`` (every draw in
    float64, then cast: a float32 and a float64 model of one seed agree)."""
    from ..models.zoology import ZoologyLM

    block, kinds = zoology_mixers(cfg, mixer)
    rng = np.random.default_rng((4, int(seed)))
    mixers = [_make(cfg, k, int(width), rng, dtype) for k in kinds]
    for k, m in zip(kinds, mixers):
        _zoology_init(k, m, rng, len(kinds))
    return ZoologyLM(cfg.vocab_size, int(width), mixers, block=block, embed_dropout=cfg.embed_dropout,
                     dtype=dtype, rng=rng)
