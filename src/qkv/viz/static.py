"""Static pictures of attention weights with matplotlib: one heatmap, or a layers × heads grid.

Both take plain NumPy arrays (no framework tensors) and write PNG or SVG, chosen by the
file's extension. matplotlib is imported inside the functions (the ``viz`` extra).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ShapeError, fmt_shape

FORMATS = (".png", ".svg")


def check_weights(weights, tokens, ndim: int, layout: str) -> tuple[np.ndarray, list[str]]:
    """``weights`` as a finite float ndarray of ``ndim`` axes ``layout`` whose last two are
    ``(T, T)`` with ``T = len(tokens)``; ``tokens`` as a list of str."""
    if hasattr(weights, "detach"):  # a torch tensor: say so rather than fail somewhere deep
        raise ShapeError("weights must be a NumPy array; got a framework tensor (call .numpy() first)")
    weights = np.asarray(weights)
    if weights.dtype.kind not in "fiu":
        raise ShapeError(f"weights must be a real number array {layout}; got dtype {weights.dtype}")
    if weights.ndim != ndim:
        raise ShapeError(f"weights must have shape {layout}; got {fmt_shape(weights.shape)}")
    if isinstance(tokens, str) or not all(isinstance(t, str) for t in tokens):
        raise ShapeError("tokens must be a list of strings, one per position")
    tokens = list(tokens)
    t = len(tokens)
    if t == 0 or weights.shape[-2:] != (t, t):
        raise ShapeError(f"weights must end in (T, T) = ({t}, {t}) with T = len(tokens) >= 1; "
                         f"got {fmt_shape(weights.shape)}")
    if not np.isfinite(weights).all():
        raise ShapeError("weights must be finite (no NaN or inf)")
    return weights.astype(np.float32, copy=False), tokens


def _labels(tokens: list[str]) -> list[str]:
    """Tokens as literal tick labels: matplotlib reads ``$...$`` as math (``"$$"`` fails to draw)."""
    return [t.replace("$", r"\$") for t in tokens]


def _check_path(path) -> Path:
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ShapeError(f"path must end in .png or .svg (the picture's format); got {str(path)!r}")
    return path


def _pyplot():
    from ..cli import require

    matplotlib = require("matplotlib", "viz")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def heatmap(weights, tokens, path, *, title: str | None = None) -> Path:
    """One ``(T, T)`` weight matrix as a heatmap (query rows, key columns) with token labels.

    A 4-D ``(layers, heads, T, T)`` array is drawn as :func:`grid`. Returns the path.
    """
    if np.ndim(weights) == 4:
        return grid(weights, tokens, path, title=title)
    weights, tokens = check_weights(weights, tokens, 2, "(T, T)")
    path = _check_path(path)
    plt = _pyplot()
    t = len(tokens)
    side = min(14, 2.5 + 0.32 * t)
    fig, ax = plt.subplots(figsize=(side + 1.2, side))
    im = ax.imshow(weights, cmap="viridis", vmin=0, vmax=max(float(weights.max()), 1e-9))
    if t <= 64:
        ax.set_xticks(range(t), _labels(tokens), rotation=90, fontsize=8)
        ax.set_yticks(range(t), _labels(tokens), fontsize=8)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    if title:
        ax.set_title(title)
    fig.colorbar(im, ax=ax, shrink=0.8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def grid(attentions, tokens, path, *, title: str | None = None) -> Path:
    """All heads of all layers, ``(layers, heads, T, T)``, as a layers × heads grid of heatmaps.

    Each cell is scaled to its own maximum so sharp and diffuse heads are both visible;
    token labels appear on the left column and bottom row while T <= 24.
    """
    attentions, tokens = check_weights(attentions, tokens, 4, "(layers, heads, T, T)")
    path = _check_path(path)
    plt = _pyplot()
    n_layers, n_heads, t, _ = attentions.shape
    cell = 1.6 if t <= 24 else 1.2
    fig, axes = plt.subplots(n_layers, n_heads, figsize=(cell * n_heads + 1, cell * n_layers + 1),
                             squeeze=False)
    labels = t <= 24
    for l in range(n_layers):
        for h in range(n_heads):
            ax = axes[l, h]
            w = attentions[l, h]
            ax.imshow(w, cmap="viridis", vmin=0, vmax=max(float(w.max()), 1e-9), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if l == 0:
                ax.set_title(f"head {h}", fontsize=8)
            if h == 0:
                ax.set_ylabel(f"layer {l}", fontsize=8)
            if labels and h == 0 and l == n_layers - 1:
                ax.set_yticks(range(t), _labels(tokens), fontsize=4)
                ax.set_xticks(range(t), _labels(tokens), fontsize=4, rotation=90)
    fig.suptitle(title or f"attention weights: {n_layers} layers × {n_heads} heads, {t} tokens "
                 "(rows attend to columns)", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
