"""``qkv train lookup``: the texts' soft dictionary lookup, learned end to end in NumPy.

The texts build attention from a dictionary lookup: a query is compared with every key,
the scores become weights, the weights average the values. Here nothing is designed:
a model sees sequences of (key, value) pairs followed by a query key and must answer the
value stored under that key. It can only do so by learning ``W_Q`` and ``W_K`` so that the
query scores its own key far above the others, and ``W_V``, ``W_O`` and the output layer
so that what comes back through the weights is that key's value.

Model (all of it ``qkv.nn``)::

    pair_j  = E_key[key_j] + E_val[value_j]              (B, n_pairs, d)
    query   = E_key[query_key]                           (B, 1, d)
    y       = Attention(query, context=pairs)            (B, 1, d)     cross-attention
    logits  = y W_out + b_out                            (B, n_values)
    loss    = cross_entropy(logits, value under the query key), optimised with Adam

``Attention`` is :class:`qkv.nn.MultiHeadAttention` (``attention="softmax"``, the default) or
:class:`qkv.nn.LinearAttention` (``attention="linear"``), with the same parameters drawn in
the same order; ``qkv experiment recall`` compares the two.

The pairs carry no position: a dictionary is a set, and attention without positions is
exactly permutation-equivariant. The held-out set is drawn from a separate stream.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from threadpoolctl import threadpool_limits

from ..errors import ShapeError
from ..extras import figure
from ..nn import Adam, Embedding, Linear, LinearAttention, MultiHeadAttention, cross_entropy

ATTENTION = {"softmax": MultiHeadAttention, "linear": LinearAttention}


@dataclass
class LookupConfig:
    """Task, model and optimiser settings of ``qkv train lookup`` (the defaults are the CLI's)."""

    n_keys: int = 64
    n_values: int = 64
    n_pairs: int = 16
    d_model: int = 64
    n_heads: int = 1
    batch: int = 128
    steps: int = 1000
    lr: float = 1e-2
    seed: int = 0
    n_eval: int = 2000
    attention: str = "softmax"

    def check(self) -> None:
        if self.attention not in ATTENTION:
            raise ShapeError(f"attention must be one of {tuple(ATTENTION)}; got {self.attention!r}")
        for name in ("n_keys", "n_values", "n_pairs", "d_model", "n_heads", "batch", "n_eval"):
            if getattr(self, name) < 1:
                raise ShapeError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.steps < 0:
            raise ShapeError(f"steps must be >= 0; got {self.steps}")
        if self.n_pairs > self.n_keys:
            raise ShapeError(f"n_pairs must be <= n_keys (keys in one sequence are distinct); "
                             f"got n_pairs = {self.n_pairs}, n_keys = {self.n_keys}")
        if self.d_model % self.n_heads:
            raise ShapeError(f"d_model must be a multiple of n_heads; got {self.d_model} and {self.n_heads}")


def lookup_batch(rng: np.random.Generator, batch: int, n_pairs: int, n_keys: int, n_values: int) -> dict:
    """One batch of the task: ``keys (B, n_pairs)`` distinct per row, ``values (B, n_pairs)``,
    ``query (B,)`` (one of the row's keys), ``slot (B,)`` (where it sits), ``target (B,)``."""
    keys = np.argsort(rng.random((batch, n_keys)), axis=1)[:, :n_pairs]  # distinct keys per row
    values = rng.integers(0, n_values, size=(batch, n_pairs))
    slot = rng.integers(0, n_pairs, size=batch)
    rows = np.arange(batch)
    return {"keys": keys, "values": values, "query": keys[rows, slot], "slot": slot,
            "target": values[rows, slot]}


class LookupModel:
    """Embeddings, one cross-attention layer (softmax or linear) and a linear read-out (see the module docstring)."""

    def __init__(self, cfg: LookupConfig, rng: np.random.Generator):
        self.cfg = cfg
        self.key_emb = Embedding(cfg.n_keys, cfg.d_model, rng=rng)
        self.val_emb = Embedding(cfg.n_values, cfg.d_model, rng=rng)
        self.attn = ATTENTION[cfg.attention](cfg.d_model, cfg.n_heads, rng=rng)
        self.out = Linear(cfg.d_model, cfg.n_values, rng=rng)
        self.layers = [self.key_emb, self.val_emb, self.attn, self.out]

    def forward(self, data: dict, return_weights: bool = False):
        """Logits ``(B, n_values)`` (and the query's weights over the pairs ``(B, H, n_pairs)``)."""
        n = self.cfg.n_pairs
        ids = np.concatenate([data["keys"], data["query"][:, None]], axis=1)  # (B, n+1): one lookup
        k_emb = self.key_emb.forward(ids)  # (B, n+1, d)
        pairs = k_emb[:, :n] + self.val_emb.forward(data["values"])  # (B, n, d)
        res = self.attn.forward(k_emb[:, n:], pairs, return_weights=return_weights)  # (B, 1, d)
        y, w = res if return_weights else (res, None)
        logits = self.out.forward(y[:, 0])  # (B, d) @ (d, n_values) -> (B, n_values)
        return (logits, w[:, :, 0]) if return_weights else logits

    def backward(self, dlogits: np.ndarray) -> None:
        """Fill every layer's grads from ``dlogits (B, n_values)``."""
        dy = self.out.backward(dlogits)[:, None]  # (B, 1, d)
        dquery, dpairs = self.attn.backward(dy)  # (B, 1, d), (B, n, d)
        self.val_emb.backward(dpairs)
        self.key_emb.backward(np.concatenate([dpairs, dquery], axis=1))

    def accuracy(self, data: dict) -> tuple[float, float]:
        """Held-out accuracy and the mean attention weight on the query's own pair."""
        logits, w = self.forward(data, return_weights=True)
        acc = float(np.mean(np.argmax(logits, axis=-1) == data["target"]))
        on_key = float(np.mean(w.mean(axis=1)[np.arange(len(w)), data["slot"]]))
        return acc, on_key


def _train_steps(model, opt, cfg, data_rng, warm, losses, progress) -> None:
    """The training loop: a fresh batch each step, warm-up then cosine learning rate."""
    for step in range(cfg.steps):
        data = lookup_batch(data_rng, cfg.batch, cfg.n_pairs, cfg.n_keys, cfg.n_values)
        loss, dlogits = cross_entropy(model.forward(data), data["target"])
        model.backward(dlogits)
        frac = (step - warm) / max(1, cfg.steps - warm)
        lr = cfg.lr * (step + 1) / warm if step < warm else cfg.lr * 0.5 * (1 + np.cos(np.pi * frac))
        opt.step(lr)
        losses.append(loss)
        if progress is not None:
            progress(step, loss)


def train_lookup(cfg: LookupConfig, progress=None) -> dict:
    """Train from ``cfg.seed``; returns the summary, the loss curve, the model and a held-out batch.

    ``progress(step, loss)`` is called after every step (the CLI draws its bar with it).
    The learning rate warms up over 5 % of the steps and then decays by a cosine to 0.
    """
    cfg.check()
    root = np.random.default_rng(cfg.seed)
    init_rng, data_rng, eval_rng = root.spawn(3)
    model = LookupModel(cfg, init_rng)
    opt = Adam(model.layers, lr=cfg.lr, clip=1.0)
    held_out = lookup_batch(eval_rng, cfg.n_eval, cfg.n_pairs, cfg.n_keys, cfg.n_values)
    losses = []
    warm = max(1, cfg.steps // 20)
    start = time.perf_counter()
    with threadpool_limits(limits=1, user_api="blas"):  # small products: BLAS threads only add overhead
        _train_steps(model, opt, cfg, data_rng, warm, losses, progress)
    seconds = time.perf_counter() - start
    acc, on_key = model.accuracy(held_out)
    summary = {"task": "lookup", "accuracy": acc, "steps": cfg.steps, "seconds": round(seconds, 3),
               "final_loss": float(np.mean(losses[-50:])) if losses else None,
               "attention_on_key": on_key, "chance": 1.0 / cfg.n_values, "config": asdict(cfg)}
    return {"summary": summary, "losses": np.array(losses), "model": model, "held_out": held_out}


# --- pictures -------------------------------------------------------------------------------

def plot_loss(losses: np.ndarray, path: str, chance: float) -> None:
    """Loss per step, its running mean, and the loss of guessing (log(n_values))."""
    fig = figure(figsize=(6, 3.5))
    ax = fig.subplots()
    if len(losses):  # --steps 0 has no curve, only the guessing line
        steps = np.arange(1, len(losses) + 1)
        ax.plot(steps, losses, lw=0.6, alpha=0.4, label="batch loss")
        k = max(1, len(losses) // 50)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1:], smooth, lw=1.8, label=f"mean of {k}")
    ax.axhline(np.log(1 / chance), color="gray", ls="--", lw=1, label="guessing")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title("qkv train lookup: learning the soft dictionary lookup")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def plot_attention(model: LookupModel, data: dict, path: str, n_rows: int = 8) -> None:
    """Heatmap: rows are held-out queries, columns the pairs; the query's own key is boxed."""
    fig = figure(figsize=(1.0 * n_rows + 2.5, 0.55 * n_rows + 1.5))
    from matplotlib.patches import Rectangle

    sub = {k: v[:n_rows] for k, v in data.items()}
    logits, w = model.forward(sub, return_weights=True)
    w = w.mean(axis=1)  # (rows, n_pairs), averaged over heads
    pred = np.argmax(logits, axis=-1)
    rows, n = w.shape
    fig.set_size_inches(1.0 * n + 2.5, 0.55 * rows + 1.5)
    ax = fig.subplots()
    im = ax.imshow(w, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    for r in range(rows):
        for j in range(n):
            ax.text(j, r, f"k{sub['keys'][r, j]}:v{sub['values'][r, j]}", ha="center", va="center",
                    fontsize=7, color="white" if w[r, j] < 0.6 else "black")
        s = sub["slot"][r]
        ax.add_patch(Rectangle((s - 0.5, r - 0.5), 1, 1, fill=False, ec="red", lw=2))
    ax.set_yticks(range(rows))
    ax.set_yticklabels([f"query k{q} -> v{p}" for q, p in zip(sub["query"], pred)])
    ax.set_xticks(range(n))
    ax.set_xticklabels([f"pair {j}" for j in range(n)])
    ax.set_title("where the query attends (red box: the pair holding its key)")
    fig.colorbar(im, ax=ax, label="attention weight")
    fig.savefig(path, dpi=120, bbox_inches="tight")
