"""``qkv experiment mqar``: which token mixers recall many keys at once (Zoology's MQAR).

Zoology (Arora et al., 2023, arXiv:2312.04927) trains 2-layer models on multi-query
associative recall (:mod:`qkv.experiments.mqar_data`: pairs, then queries of their keys,
answered by their values) and finds: attention solves it at every model width; gated
convolutions and linear recurrences need a width that grows with the number of pairs (their
state must hold every pair); hybrids with one attention layer close most of the gap.

Here the same on qkv's GPT (:class:`qkv.models.GPT`, ``GPTConfig(layers=...)``): for each
mixer (``attention``, ``linear``, ``mamba2``, ``gated_delta``, ``rglru``, and the hybrids
``attention+X``: an attention layer then an X layer) and each width ``n_embd``, one 2-layer
model trained on Zoology's mixture of (pairs, T) tasks (:meth:`MQARConfig.tasks`, one task a
step), then its accuracy at the query positions of held-out sequences of each pair count at
``T = seq_len``. Every attention layer (of the ``attention`` models and of the hybrids) is, as
in Zoology's MQAR models, a short convolution then attention (``attention_conv = 3``: the
``attention:conv=3`` mixer, :class:`qkv.nn.ConvAttention`, Zoology's ``Hybrid([BaseConv, MHA])``),
with RoPE; ``attention_conv = 0`` makes it plain attention. Training is ``qkv train gpt``'s step
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
RECIPE = {"attention": (1000, 3e-3), **{m: (2500, 1e-2) for m in RECURRENT}, **{m: (2000, 3e-3) for m in HYBRIDS}}
"""``(steps, lr)`` of each mixer's models when ``MQARConfig.steps`` / ``lr`` are ``None``.

From probes at width 64 on 4 pairs at T = 64 alone (batch 16, warm-up 50 then cosine): attention
solves MQAR in 700 steps at lr 3e-3; the recurrences stay at chance at 3e-3 through 1000 steps,
while at 1e-2 Gated DeltaNet learns (loss 3.56, accuracy 0.38 at step 1000 and falling fast) and
RG-LRU starts to (accuracy 0.16 at 1500), Mamba-2 not within 1500 steps (loss 4.89); the hybrids
(attention first) learn at 3e-3 (attention+mamba2: 0.96 at step 500 of 750), not at 1e-2 (0.10
at 750). In the mixture half the steps are 4 pairs,
hence 2500 steps for the recurrences, 2000 for the hybrids. The full grid with
:attr:`MQARConfig.stop_loss` (12 of the 15 attention and hybrid models stop solved, after 474
to 1809 steps) took 3165 s wall with ``workers = 2`` on a 2.0 GHz Intel Xeon (6290 s of CPU,
4770 of them the twelve pure recurrences, which never stop); run as AVX2 on the same machine,
after the heap setting and the RG-LRU's compiled passes, 3354 s (6659 s of CPU)."""


@dataclass
class MQARConfig:
    """Settings of ``qkv experiment mqar`` (the defaults are the full grid; see :meth:`quick`).

    Zoology's: vocabulary 8192, 180 000 training sequences (100 000 of 4 pairs at T = 64,
    20 000 each of 8 pairs at T = 128 and 16, 32, 64 pairs at T = 256), 32 to 64 epochs of
    batch 256, lr swept in [1e-3, 3e-2], widths 64 … 512. Here, for a CPU: the same mixture
    of lengths (:meth:`tasks`: a step's batch is one task, in the order of :meth:`schedule`),
    vocabulary ``vocab_size``, ``steps`` steps of ``batch`` fresh sequences at learning rate
    ``lr``; evaluated at ``seq_len`` for every pair count. ``steps`` / ``lr`` ``None`` (the
    defaults): each mixer's own from :data:`RECIPE` (:meth:`steps_of`, :meth:`lr_of`), as Zoology
    tunes each mixer's lr; a number: that for every model. ``workers``: models trained at
    once, in processes of one thread each (the results are the same bits as one worker's: every model is made and fed
    from ``seed`` alone, on one thread). ``attention_conv``: the taps of the short convolution
    before every attention layer (Zoology's BaseConv, kernel 3 as its models have it; 0 = plain
    attention). ``stop_loss``: a model that has solved the task stops early, once the mean loss of
    its last :meth:`cycle` steps (every task at least once) is below it (0.03: the value's mean
    probability above 0.97); ``None`` or 0 trains every step. (Zoology trains a fixed number of
    epochs; here the grid's hour on 2 cores is spent on the models still learning.)
    """

    mixers: tuple = MIXERS + HYBRIDS
    widths: tuple = (32, 64, 128)
    pairs: tuple = (4, 8, 16, 32, 64)
    seq_len: int = 256
    vocab_size: int = 288
    n_head: int = 2
    positions: str = "rope"
    steps: int | None = None
    batch: int = 16
    lr: float | None = None
    warmup: int = 50
    weight_decay: float = 0.0
    n_eval: int = 48
    seed: int = 0
    workers: int = 1
    attention_conv: int = 3
    stop_loss: float | None = 0.03

    @classmethod
    def quick(cls) -> "MQARConfig":
        """Under 3 minutes on 2 cores: attention, Mamba-2 and their hybrid at width 64 on 4 and
        8 pairs (T = 64 and 128), evaluated at T = 128."""
        return cls(mixers=("attention", "mamba2", "attention+mamba2"), widths=(64,), pairs=(4, 8),
                   seq_len=128, steps=300, n_eval=32)

    def tasks(self) -> list[tuple[int, int]]:
        """``(pairs, T)`` of each training task: Zoology's lengths, ``T = 16 · pairs`` (64 for 4
        pairs, 128 for 8), at most ``seq_len``."""
        return [(int(p), min(self.seq_len, 16 * int(p))) for p in self.pairs]

    def steps_of(self, mixer: str) -> int:
        """Training steps of ``mixer``'s models: ``steps``, or :data:`RECIPE`'s for ``None``."""
        return RECIPE[_known(mixer)][0] if self.steps is None else self.steps

    def lr_of(self, mixer: str) -> float:
        """Peak learning rate of ``mixer``'s models: ``lr``, or :data:`RECIPE`'s for ``None``."""
        return RECIPE[_known(mixer)][1] if self.lr is None else self.lr

    def cycle(self) -> int:
        """Steps after which :meth:`schedule` repeats: every task at least once."""
        return 2 * len(self.pairs) - 1

    def schedule(self, step: int) -> tuple[int, int]:
        """The task of training step ``step``: the fewest pairs every other step, the others in turn
        between them (for 4 … 64 pairs: 4, 8, 4, 16, 4, 32, 4, 64, 4, again; Zoology's 100 000
        sequences of 4 pairs against 20 000 of each other count)."""
        tasks = self.tasks()
        cycle = [0] + [j for i in range(1, len(tasks)) for j in (i, 0)]
        return tasks[cycle[step % len(cycle)]]

    def check(self, available=None) -> None:
        """A ShapeError for a setting no model can train with: an unknown or repeated mixer, width
        or pair count, a task the vocabulary cannot hold, or a widest model that needs more memory
        than the machine has ``available`` (bytes; default: :func:`qkv.models.memory.available_memory`)."""
        if not self.mixers or not self.widths or not self.pairs:
            raise ShapeError("mixers, widths and pairs must each name at least one value; got "
                             f"{len(self.mixers)}, {len(self.widths)} and {len(self.pairs)}")
        for name in ("mixers", "widths", "pairs"):
            values = list(getattr(self, name))
            twice = sorted({str(v) for v in values if values.count(v) > 1})
            if twice:
                raise ShapeError(f"{name} must name each value once (each is one model, or one column); "
                                 f"got {', '.join(twice)} more than once")
        positive_int("attention_conv", self.attention_conv, 0)
        for m in self.mixers:
            layers(m)
        if self.stop_loss is not None and not (isinstance(self.stop_loss, (int, float)) and
                                               0 <= self.stop_loss < float("inf")):
            raise ShapeError(f"stop_loss must be a finite number >= 0 or None; got {self.stop_loss!r}")
        for name in ("n_head", "steps", "batch", "n_eval", "workers"):
            if not (name == "steps" and self.steps is None):
                positive_int(name, getattr(self, name))
        for w in self.widths:
            if positive_int("widths", w) % self.n_head:
                raise ShapeError(f"widths must be multiples of n_head = {self.n_head}; got {w}")
        for p, t in self.tasks():
            check_task(p, t, self.vocab_size)
            check_task(p, self.seq_len, self.vocab_size)
        self.model_config(self.mixers[0], self.widths[0])
        for m in self.mixers:
            self.train_config(m, self.widths[0]).check()
        from ..models.memory import check_fits

        check_fits(self.train_config(self.mixers[0], max(self.widths)), self.vocab_size,
                   {"n_embd": "widths", "batch_size": "batch", "block_size": "seq_len", "n_layer": None}, available)

    def model_config(self, mixer: str, width: int):
        """The :class:`qkv.models.GPTConfig` of one (mixer, width) model: 2 layers, no dropout."""
        from ..models import GPTConfig

        return GPTConfig(vocab_size=self.vocab_size, block_size=self.seq_len, n_layer=2, n_head=self.n_head,
                         n_embd=int(width), positions=self.positions, seed=self.seed,
                         layers=layers(mixer, self.attention_conv))

    def train_config(self, mixer: str, width: int):
        """The :class:`qkv.models.trainconfig.TrainConfig` of one (mixer, width) model (its
        optimizer and schedule: AdamW, clipping at 1, warm-up then cosine to lr / 10; the mixer's
        :meth:`steps_of` and :meth:`lr_of`)."""
        from ..models.trainconfig import TrainConfig

        return TrainConfig(block_size=self.seq_len, batch_size=self.batch, n_layer=2, n_head=self.n_head,
                           n_embd=int(width), lr=self.lr_of(mixer), warmup=self.warmup, steps=self.steps_of(mixer),
                           weight_decay=self.weight_decay, seed=self.seed, vocab_size=self.vocab_size,
                           layers=layers(mixer, self.attention_conv))

    @property
    def n_steps(self) -> int:
        """Training steps in all (``progress`` counts them)."""
        return len(self.widths) * sum(self.steps_of(m) for m in self.mixers)


def _known(mixer: str) -> str:
    """``mixer`` if it is one of :data:`RECIPE`'s, else the ShapeError of :func:`layers`."""
    if mixer not in RECIPE:
        layers(mixer)
    return mixer


def layers(mixer: str, conv: int = 0) -> str:
    """``GPTConfig.layers`` of a 2-layer model: ``"mamba2"`` -> ``"mamba2,mamba2"``; a hybrid
    ``"attention+mamba2"`` -> ``"attention,mamba2"``: attention first, on the embeddings. With the
    recurrent layer first (the order of Jamba's, Qwen3-Next's and Griffin's patterns) its block
    writes 10 times the embeddings' size into the residual stream within 100 steps (Mamba-2 and its
    MLP: 0.19 and 0.44 rms against the embeddings' 0.036), the attention behind it no longer
    matches the key tokens, and no hybrid learned (300 steps, 4 pairs at T = 64, width 64:
    accuracy 0.03 for attention+mamba2 and attention+gated_delta, against 0.12 and 0.58 with
    attention first, and 0.55 with the recurrent layer's output zeroed).
    ``conv`` > 0: every attention layer is ``attention:conv=<conv>`` (``"attention"`` ->
    ``"attention:conv=3,attention:conv=3"``)."""
    parts = mixer.split("+") if isinstance(mixer, str) else [None]
    attention = f"attention:conv={conv}" if conv else "attention"
    if len(parts) == 1 and parts[0] in MIXERS:
        first = attention if parts[0] == "attention" else parts[0]
        return f"{first},{first}"
    if len(parts) == 2 and parts[0] == "attention" and parts[1] in RECURRENT:
        return f"{attention},{parts[1]}"
    raise ShapeError(f"mixers must be among {list(MIXERS)} or a hybrid {list(HYBRIDS)}; got {mixer!r}")


def mixture(rng: np.random.Generator, batch: int, pairs, seq_len: int, vocab_size: int) -> tuple:
    """A batch ``(inputs, targets)`` ``(batch, T)`` whose rows share out the pair counts
    (``batch // len(pairs)`` rows each, the first counts one more until ``batch`` is reached)."""
    sizes = [batch // len(pairs) + (i < batch % len(pairs)) for i in range(len(pairs))]
    parts = [mqar_batch(rng, n, p, seq_len, vocab_size) for n, p in zip(sizes, pairs) if n]
    return (np.concatenate([d["inputs"] for d in parts]), np.concatenate([d["targets"] for d in parts]))


def evaluate(model, cfg: MQARConfig, chunk: int = 16) -> list[float]:
    """Accuracy at the query positions of ``n_eval`` held-out sequences of each pair count at
    ``T = seq_len`` (the same sequences for every model: a Generator made afresh from the seed)."""
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
    """Train one (mixer, width) model on the tasks; returns ``{"accuracy": [per pair count],
    "final_loss", "seconds", "params", "steps", "max_steps", "lr"}`` (``steps``: the steps taken,
    fewer than ``max_steps`` where the model met ``cfg.stop_loss``). ``progress()`` is called
    after every step (and once for each step left out by an early stop). A model whose numbers
    stop being finite raises :class:`qkv.models.training.Diverged` with ``model`` naming it.

    On one thread (kernels and BLAS): the same bits in any process, whatever ran before."""
    from ..models import GPT
    from ..models.training import Diverged, Run, make_optimizer, train_step
    from ..threads import kernel_threads

    tc = cfg.train_config(mixer, width).resolved()
    model = GPT(cfg.model_config(mixer, width))
    run = Run(tc, model, make_optimizer(model, tc), np.random.default_rng((1, cfg.seed)), None, {"kind": "mqar"})
    start, losses, steps, window = time.perf_counter(), [], cfg.steps_of(mixer), cfg.cycle()
    with threadpool_limits(limits=1, user_api="blas"), kernel_threads(1):
        for step in range(steps):
            pairs, t = cfg.schedule(step)
            d = mqar_batch(run.rng, cfg.batch, pairs, t, cfg.vocab_size)
            try:
                losses.append(train_step(run, d["inputs"], d["targets"]))
            except Diverged as err:
                err.model = f"{mixer} at width {width}"  # which of the grid's models
                raise
            if progress is not None:
                progress()
            if cfg.stop_loss and step + 1 >= max(window, cfg.warmup) and np.mean(losses[-window:]) < cfg.stop_loss:
                break
        seconds = time.perf_counter() - start
        for _ in range(steps - len(losses) if progress is not None else 0):
            progress()
        accuracy = evaluate(model, cfg)
    last = losses[-5 * len(cfg.pairs):]
    return {"accuracy": accuracy, "final_loss": float(np.mean(last)), "seconds": round(seconds, 2),
            "params": model.num_params(), "steps": len(losses), "max_steps": steps, "lr": cfg.lr_of(mixer)}


def _train_job(job: tuple) -> dict:
    """``train_one(cfg, mixer, width)`` in a worker process."""
    cfg, mixer, width = job
    return train_one(cfg, mixer, width)


def _each_model(cfg: MQARConfig, step):
    """``((mixer, width), result)`` for every model, in ``cfg.workers`` processes (the widest
    first, so that the last to finish are short), or in this one for ``workers = 1``."""
    jobs = [(m, int(w)) for m in cfg.mixers for w in cfg.widths]
    if cfg.workers == 1 or len(jobs) == 1:
        for m, w in jobs:
            yield (m, w), train_one(cfg, m, w, step)
        return
    import multiprocessing

    order = sorted(jobs, key=lambda j: -j[1])
    ctx = multiprocessing.get_context("spawn")  # no inherited thread pools or locks
    from ..heap import keep_freed_memory

    with ctx.Pool(min(cfg.workers, len(jobs)), initializer=keep_freed_memory) as pool:
        for job, r in zip(order, pool.imap(_train_job, [(cfg, m, w) for m, w in order])):
            for _ in range(cfg.steps_of(job[0])):
                step()
            yield job, r


def mqar_experiment(cfg: MQARConfig | None = None, progress=None) -> dict:
    """Train every (mixer, width) model; returns the record written as ``mqar.json``.

    ``rows``: one ``{mixer, width, pairs, accuracy}`` per (mixer, width, pair count), in the
    order of ``mixers`` then ``widths``; ``runs``: one ``{mixer, width, final_loss, seconds,
    params, steps, max_steps, lr}`` per model; ``chance`` (1 / values); ``tasks`` (the training ``[pairs, T]``);
    ``seconds`` (wall, all models); ``config``. ``progress(done, total)`` is called after every
    training step (with workers: a model's steps at once, when it is done).
    """
    cfg = cfg or MQARConfig()
    cfg.check()
    done = 0

    def step():
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, cfg.n_steps)

    start = time.perf_counter()
    results = dict(_each_model(cfg, step))
    rows, runs = [], []
    for mixer in cfg.mixers:
        for width in cfg.widths:
            r = results[(mixer, int(width))]
            rows += [{"mixer": mixer, "width": int(width), "pairs": int(p), "accuracy": a}
                     for p, a in zip(cfg.pairs, r["accuracy"])]
            runs.append({"mixer": mixer, "width": int(width), "final_loss": r["final_loss"],
                         "seconds": r["seconds"], "params": r["params"], "steps": r["steps"],
                         "max_steps": r["max_steps"], "lr": r["lr"]})
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}
    return {"rows": rows, "runs": runs, "chance": 1.0 / (cfg.vocab_size - cfg.vocab_size // 2),
            "tasks": [list(t) for t in cfg.tasks()], "seconds": round(time.perf_counter() - start, 1),
            "config": config}
