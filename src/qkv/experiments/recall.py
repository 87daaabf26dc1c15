"""``qkv experiment recall``: does linear attention recall from its context as softmax does?

The texts: linear-attention hybrids "get sub-quadratic scaling without giving up in-context
recall", and yet "every one of those hybrids still uses scaled dot-product attention in at
least half its layers". Why keep it? Linear attention squeezes the whole context into a
state ``S = Σ_j φ(k_j)ᵀ [v_j | 1]`` of ``D·(D + 1)`` numbers, and a query reads it back as
``φ(q) S``. Its weights ``φ(q)·φ(k_j)`` are positive products of positive features: two
keys stay apart only as far as their features do not overlap, and D dimensions hold at
most D non-overlapping feature vectors, so as the pairs in context grow every lookup
picks up more of the others' values. Softmax keeps every key and ``exp`` sharpens the
best match to (nearly) one-hot at any count.

Measured: the texts' soft dictionary lookup, exactly as ``qkv train lookup`` learns it
(:mod:`qkv.experiments.lookup`: its data and its model, with the attention layer
swapped), for ``n`` (key, value) pairs in context, n = 4 … 128, learned once with
:class:`qkv.nn.MultiHeadAttention` and once with :class:`qkv.nn.LinearAttention` of the
same width, heads and seed. Reported: held-out accuracy and the mean weight the query
puts on the pair holding its key.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..errors import ShapeError
from ..extras import figure
from .lookup import LookupConfig, train_lookup

METHODS = ("softmax", "linear")


@dataclass
class RecallConfig:
    """Settings of ``qkv experiment recall`` (the defaults are the full run; see :meth:`quick`)."""

    pairs: tuple = (4, 8, 16, 32, 64, 128)
    n_keys: int = 256
    n_values: int = 64
    d_model: int = 32
    n_heads: int = 1
    steps: int = 1000
    batch: int = 128
    lr: float = 1e-2
    n_eval: int = 2000
    seed: int = 0

    @classmethod
    def quick(cls) -> "RecallConfig":
        """Under a minute: three pair counts, short training."""
        return cls(pairs=(4, 16, 64), steps=300, n_eval=1000)

    def lookup(self, n_pairs: int, attention: str) -> LookupConfig:
        """The :class:`~qkv.experiments.lookup.LookupConfig` of one run."""
        return LookupConfig(n_keys=self.n_keys, n_values=self.n_values, n_pairs=int(n_pairs),
                            d_model=self.d_model, n_heads=self.n_heads, batch=self.batch, steps=self.steps,
                            lr=self.lr, seed=self.seed, n_eval=self.n_eval, attention=attention)

    def check(self) -> None:
        if not self.pairs:
            raise ShapeError("pairs must name at least one pair count; got none")
        for n in self.pairs:
            self.lookup(n, "softmax").check()

    @property
    def n_steps(self) -> int:
        """Training steps in all (``progress`` is called after each)."""
        return len(self.pairs) * len(METHODS) * self.steps


def recall_experiment(cfg: RecallConfig | None = None, progress=None) -> dict:
    """Train both attentions at every pair count; returns the record written as ``recall.json``.

    Keys: ``pairs``; ``softmax`` and ``linear`` (held-out accuracy per pair count);
    ``attention_on_key`` (per method: mean weight on the query's own pair); ``final_loss``;
    ``chance`` (1 / n_values); ``d_head``; ``config``. ``progress(done, total)`` is called
    after every training step.
    """
    cfg = cfg or RecallConfig()
    cfg.check()
    rec = {"pairs": [int(n) for n in cfg.pairs], "softmax": [], "linear": [],
           "attention_on_key": {m: [] for m in METHODS}, "final_loss": {m: [] for m in METHODS},
           "chance": 1.0 / cfg.n_values, "d_head": cfg.d_model // cfg.n_heads}
    done = 0
    for n in rec["pairs"]:
        for m in METHODS:
            def step(_step, _loss):
                nonlocal done
                done += 1
                if progress is not None:
                    progress(done, cfg.n_steps)
            s = train_lookup(cfg.lookup(n, m), progress=step)["summary"]
            rec[m].append(s["accuracy"])
            rec["attention_on_key"][m].append(s["attention_on_key"])
            rec["final_loss"][m].append(s["final_loss"])
    config = asdict(cfg)
    config["pairs"] = list(cfg.pairs)
    rec["config"] = config
    return rec


def format_table(rec: dict) -> str:
    """The record as Markdown: accuracy and weight on the right pair, per pair count."""
    lines = [f"held-out accuracy (chance {rec['chance']:.3f}); in brackets the mean weight on the right pair; "
             f"d_model {rec['config']['d_model']}, {rec['config']['n_heads']} head(s), "
             f"{rec['config']['steps']} steps each", "",
             "| pairs | softmax | linear |", "|---:|---:|---:|"]
    for i, n in enumerate(rec["pairs"]):
        cells = [f"{rec[m][i]:.3f} ({rec['attention_on_key'][m][i]:.2f})" for m in METHODS]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rec: dict, path) -> None:
    """Two panels against the number of pairs: held-out accuracy, weight on the right pair."""
    fig = figure(figsize=(11, 4))
    axes = fig.subplots(1, 2)
    pairs = np.array(rec["pairs"], dtype=float)
    style = {"softmax": ("s-", "C0", "softmax attention"), "linear": ("D-", "C1", "linear attention (φ = elu + 1)")}
    for m, (marker, color, label) in style.items():
        axes[0].semilogx(pairs, rec[m], marker, color=color, label=label, base=2)
        axes[1].semilogx(pairs, rec["attention_on_key"][m], marker, color=color, label=label, base=2)
    axes[0].axhline(rec["chance"], color="gray", ls=":", lw=1, label="chance")
    axes[0].set_ylim(0, 1.02)
    axes[0].set_ylabel("held-out accuracy")
    axes[0].set_title("recall: the value stored under the query's key")
    axes[1].semilogx(pairs, 1 / pairs, ":", color="gray", lw=1, label="uniform (1 / pairs)", base=2)
    axes[1].set_ylim(0, 1.02)
    axes[1].set_ylabel("mean weight on the right pair")
    axes[1].set_title("how sharply the query finds its key")
    for ax in axes:
        ax.axvline(rec["d_head"], color="gray", ls="--", lw=0.8)
        ax.text(rec["d_head"], 0.03, f" d_head = {rec['d_head']}", fontsize=8, color="gray")
        ax.set_xlabel("(key, value) pairs in context")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    c = rec["config"]
    fig.suptitle(f"qkv experiment recall: the same lookup model, softmax vs linear attention "
                 f"(d_model {c['d_model']}, {c['n_heads']} head, {c['n_keys']} keys, {c['steps']} steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
