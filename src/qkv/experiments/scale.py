"""``qkv experiment scale``: the texts' §7 measured — why scores are divided by √d_k.

The claim: if the components of q and k are independent with mean 0 and variance 1, then

    Var(q · k) = Σ_i Var(q_i k_i) = d_k          (each term has variance 1·1)

so raw scores grow like √d_k; softmax of large scores is nearly one-hot ("saturated") and
its Jacobian ``J = diag(p) - p pᵀ`` goes to 0, so almost no gradient flows back to q and k.
Dividing by √d_k keeps the score variance at 1 and the softmax in its sloped regime.

Measured here for each d_k: ``n_samples`` queries, each against ``n_keys`` random keys,
weights from :func:`qkv.attention` with ``scale=1`` (raw) and the default ``1/√d_k``.
``‖J‖_F`` per row is ``sqrt(Σp² - 2Σp³ + (Σp²)²)``: the Frobenius norm of
``diag(p) - p pᵀ``, written out so no ``(T, T)`` matrix is built.
"""
from __future__ import annotations

import numpy as np

from ..api import attention
from ..errors import ShapeError
from ..extras import figure

DEFAULT_DK = (1, 4, 16, 64, 256, 1024)


def jacobian_norm(p: np.ndarray) -> np.ndarray:
    """Frobenius norm of the softmax Jacobian ``diag(p) - p pᵀ`` for each row of ``p (..., T)``."""
    s2, s3 = np.sum(p * p, axis=-1), np.sum(p ** 3, axis=-1)
    return np.sqrt(np.maximum(s2 - 2 * s3 + s2 * s2, 0.0))


def scale_experiment(d_ks=DEFAULT_DK, *, n_keys: int = 32, n_samples: int = 512, seed: int = 0) -> list[dict]:
    """One row per d_k: score variance, saturation and softmax-gradient size, raw and scaled.

    Row keys: ``d_k``, ``var_raw`` (Var q·k), ``var_scaled`` (Var q·k/√d_k), ``max_w_raw``
    and ``max_w_scaled`` (mean largest weight of a row), ``saturated_raw`` and
    ``saturated_scaled`` (share of rows whose largest weight exceeds 0.99), ``jac_raw`` and
    ``jac_scaled`` (median ‖J‖_F over rows: the typical row). For T keys a uniform row has max weight 1/T and
    ``‖J‖_F ≈ 1/sqrt(T)``; a one-hot row has max weight 1 and ``‖J‖_F = 0``.
    """
    if n_keys < 2 or n_samples < 2:
        raise ShapeError(f"n_keys and n_samples must be >= 2; got {n_keys} and {n_samples}")
    rng = np.random.default_rng(seed)
    rows = []
    for d in d_ks:
        if int(d) < 1:
            raise ShapeError(f"every d_k must be >= 1; got {d}")
        d = int(d)
        q = rng.standard_normal((n_samples, 1, d))  # (N, 1, d): one query per sample
        k = rng.standard_normal((n_samples, n_keys, d))  # (N, T, d): its keys
        v = np.zeros((n_samples, n_keys, 1))  # values do not matter here
        dots = (q @ np.swapaxes(k, -1, -2))[:, 0]  # (N, 1, d) @ (N, d, T) -> (N, 1, T) -> (N, T)
        _, p_raw = attention(q, k, v, scale=1.0, return_weights=True, method="reference")
        _, p_scl = attention(q, k, v, return_weights=True, method="reference")
        p_raw, p_scl = p_raw[:, 0], p_scl[:, 0]  # (N, T)
        rows.append({
            "d_k": d,
            "var_raw": float(np.var(dots)),
            "var_scaled": float(np.var(dots / np.sqrt(d))),
            "max_w_raw": float(np.mean(p_raw.max(-1))),
            "max_w_scaled": float(np.mean(p_scl.max(-1))),
            "saturated_raw": float(np.mean(p_raw.max(-1) > 0.99)),
            "saturated_scaled": float(np.mean(p_scl.max(-1) > 0.99)),
            "jac_raw": float(np.median(jacobian_norm(p_raw))),
            "jac_scaled": float(np.median(jacobian_norm(p_scl))),
        })
    return rows


def format_table(rows: list[dict], n_keys: int) -> str:
    """The rows as a Markdown table."""
    lines = [f"softmax over {n_keys} keys; q, k ~ N(0, 1); raw = q·k, scaled = q·k/√d_k", "",
             "| d_k | Var(q·k) | Var(q·k/√d_k) | max weight raw | max weight scaled "
             "| rows > 0.99 raw | median ‖J‖ raw | median ‖J‖ scaled |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['d_k']} | {r['var_raw']:.1f} | {r['var_scaled']:.2f} | {r['max_w_raw']:.3f} "
                     f"| {r['max_w_scaled']:.3f} | {100 * r['saturated_raw']:.0f} % | {r['jac_raw']:.2e} "
                     f"| {r['jac_scaled']:.2e} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, n_keys: int) -> None:
    """Three panels over d_k: score variance, largest weight, softmax Jacobian norm."""
    d = np.array([r["d_k"] for r in rows])
    fig = figure(figsize=(13, 3.8))
    axes = fig.subplots(1, 3)
    ax = axes[0]
    ax.loglog(d, [r["var_raw"] for r in rows], "o-", label="Var(q·k)")
    ax.loglog(d, [r["var_scaled"] for r in rows], "s-", label="Var(q·k / √d_k)")
    ax.loglog(d, d, "k--", lw=1, label="d_k")
    ax.set_title("scores: variance grows like d_k")
    ax.set_xlabel("d_k")
    ax.legend()
    ax = axes[1]
    ax.semilogx(d, [r["max_w_raw"] for r in rows], "o-", label="raw")
    ax.semilogx(d, [r["max_w_scaled"] for r in rows], "s-", label="÷ √d_k")
    ax.axhline(1 / n_keys, color="gray", ls=":", label=f"uniform (1/{n_keys})")
    ax.set_ylim(0, 1.05)
    ax.set_title("softmax saturates: mean largest weight")
    ax.set_xlabel("d_k")
    ax.legend()
    ax = axes[2]
    ax.loglog(d, [max(r["jac_raw"], 1e-12) for r in rows], "o-", label="raw")
    ax.loglog(d, [r["jac_scaled"] for r in rows], "s-", label="÷ √d_k")
    ax.set_title("gradient vanishes: median ‖diag(p) − ppᵀ‖_F")
    ax.set_xlabel("d_k")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
