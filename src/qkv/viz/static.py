"""Static pictures of attention weights with matplotlib: one heatmap, or a layers × heads grid.

Both take plain NumPy arrays (no framework tensors) and write PNG or SVG, chosen by the
file's extension. matplotlib is imported inside the functions (the ``viz`` extra).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ShapeError, fmt_shape
from ..extras import figure

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


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _tick_positions(t: int, room: int) -> list[int]:
    """At most ``room`` evenly spaced positions of ``0..t-1`` (all of them when they fit)."""
    if t <= room:
        return list(range(t))
    step = -(-t // room)
    return list(range(0, t, step))


def heatmap(weights, tokens, path, *, title: str | None = None) -> Path:
    """One ``(T, T)`` weight matrix as a heatmap (query rows, key columns) with token labels.

    A 4-D ``(layers, heads, T, T)`` array is drawn as :func:`grid`. Returns the path.
    """
    if np.ndim(weights) == 4:
        return grid(weights, tokens, path, title=title)
    weights, tokens = check_weights(weights, tokens, 2, "(T, T)")
    path = _check_path(path)
    t = len(tokens)
    side = min(14, 2.5 + 0.32 * t)
    fig = figure(figsize=(side + 1.2, side))
    ax = fig.subplots()
    im = ax.imshow(weights, cmap="viridis", vmin=0, vmax=max(float(weights.max()), 1e-9))
    ticks = _tick_positions(t, 64)
    shown = _labels([tokens[i] for i in ticks])
    ax.set_xticks(ticks, shown, rotation=90, fontsize=8)
    ax.set_yticks(ticks, shown, fontsize=8)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    if title:
        ax.set_title(title)
    fig.colorbar(im, ax=ax, shrink=0.8, label="attention weight")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def grid(attentions, tokens, path, *, title: str | None = None) -> Path:
    """All heads of all layers, ``(layers, heads, T, T)``, as a layers × heads grid of heatmaps.

    Every cell shares one colour scale, drawn as a colorbar: a square-root scale from 0 to
    the largest weight, so both sharp and diffuse heads show. Token labels run down the
    left column (queries) and along the bottom row (keys) of every edge cell; past about 40
    tokens every second (third, ...) token is labelled.
    """
    from matplotlib.colors import PowerNorm

    attentions, tokens = check_weights(attentions, tokens, 4, "(layers, heads, T, T)")
    path = _check_path(path)
    n_layers, n_heads, t, _ = attentions.shape
    cell = 2.4 if t <= 24 else 3.0
    fig = figure(figsize=(cell * n_heads + 2.2, cell * n_layers + 1.6), layout="constrained")
    axes = fig.subplots(n_layers, n_heads, squeeze=False)
    norm = PowerNorm(0.5, vmin=0.0, vmax=max(float(attentions.max()), 1e-9))
    ticks = _tick_positions(t, 40)
    shown = _labels([tokens[i] for i in ticks])
    size = 7 if len(ticks) <= 16 else 5
    for l in range(n_layers):
        for h in range(n_heads):
            ax = axes[l, h]
            im = ax.imshow(attentions[l, h], cmap="viridis", norm=norm, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if l == 0:
                ax.set_title(f"head {h}", fontsize=9)
            if h == 0:
                ax.set_yticks(ticks, shown, fontsize=size)
                ax.set_ylabel(f"layer {l}", fontsize=9)
            if l == n_layers - 1:
                ax.set_xticks(ticks, shown, fontsize=size, rotation=90)
    fig.colorbar(im, ax=axes, shrink=0.6, label="attention weight (one scale for all cells)")
    fig.suptitle(title or f"attention weights: {_plural(n_layers, 'layer')} × {_plural(n_heads, 'head')}, "
                 f"{_plural(t, 'token')} (rows attend to columns)", fontsize=11)
    fig.savefig(path, dpi=110)
    return path
