"""The texts' worked examples, computed by qkv and checked against what the texts print (``qkv demo``).

The teaching texts worked their numbers by hand. Each printed number is checked here
against what the math gives; where a text's number differs, the demo says so beside it.
The functions return plain dicts of arrays so tests can check the same numbers.
"""
from __future__ import annotations

import numpy as np

from ..api import attention
from ..numerics import softmax
from ..extras import figure

# --- the examples ------------------------------------------------------------------------

# S036 §5: three tokens, d_model = d_k = 2, W_Q = W_K = W_V = I, so Q = K = V = X.
THREE_TOKENS_X = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
THREE_TOKENS_PRINTED = {  # what the text prints, rounded as it rounds
    "scaled": np.array([[0.707, 0.000, 0.707], [0.000, 0.707, 0.707], [0.707, 0.707, 1.414]]),
    "weights": np.array([[0.401, 0.198, 0.401], [0.198, 0.401, 0.401], [0.288, 0.288, 0.424]]),
    "output": np.array([[0.802, 0.599], [0.599, 0.802], [0.712, 0.712]]),
}

# S036 §2-3: a soft dictionary lookup over "cat", "dog", "fish" (no 1/sqrt(d) in the text).
LOOKUP_K = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
LOOKUP_V = np.array([[10.0, 0.0], [9.0, 1.0], [0.0, 10.0]])
LOOKUP_Q = np.array([1.0, 0.05])
LOOKUP_NAMES = ("cat", "dog", "fish")
LOOKUP_PRINTED = {
    "scores": np.array([1.00, 0.905, 0.05]),
    "weights": np.array([0.46, 0.42, 0.12]),
    "output": np.array([8.62, 1.62]),
}


def three_tokens() -> dict:
    """Scores, scaled scores, weights and output of the 3-token example, by qkv.attention."""
    x = THREE_TOKENS_X
    w_q = w_k = w_v = np.eye(2)
    q, k, v = x @ w_q, x @ w_k, x @ w_v  # (T, d_model) @ (d_model, d_k) -> (T, d_k)
    scores = q @ k.T  # (T, d_k) @ (d_k, T) -> (T, T)
    scaled = scores / np.sqrt(k.shape[-1])
    out, weights = attention(q, k, v, return_weights=True, method="reference")
    return {"x": x, "scores": scores, "scaled": scaled, "weights": weights, "output": out}


def soft_lookup() -> dict:
    """The soft dictionary lookup as the text does it (scale 1) and with 1/sqrt(d)."""
    q = LOOKUP_Q[None, :]  # one query: (1, d)
    scores = (LOOKUP_K @ LOOKUP_Q)  # (3, d) @ (d,) -> (3,)
    out, weights = attention(q, LOOKUP_K, LOOKUP_V, scale=1.0, return_weights=True, method="reference")
    out_s, weights_s = attention(q, LOOKUP_K, LOOKUP_V, return_weights=True, method="reference")
    return {"scores": scores, "weights": weights[0], "output": out[0],
            "weights_scaled": weights_s[0], "output_scaled": out_s[0]}


def scaling(d_k: int = 512, n: int = 8, seed: int = 0) -> dict:
    """What 1/sqrt(d_k) does: one query against n random unit-variance keys at d_k."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, d_k))
    k = rng.standard_normal((n, d_k))
    raw = (q @ k.T)[0]  # (1, d_k) @ (d_k, n) -> (n,)
    w_raw = softmax(raw)
    w_scaled = softmax(raw / np.sqrt(d_k))
    # The softmax Jacobian diag(w) - w wᵀ: its size says how much gradient flows back.
    jac = lambda w: np.abs(np.diag(w) - np.outer(w, w)).sum()  # noqa: E731
    many = rng.standard_normal((2000, d_k)) @ rng.standard_normal((d_k,))  # 2000 samples of q·k
    return {"d_k": d_k, "raw": raw, "weights_unscaled": w_raw, "weights_scaled": w_scaled,
            "score_std": float(many.std()), "score_std_scaled": float((many / np.sqrt(d_k)).std()),
            "jacobian_unscaled": float(jac(w_raw)), "jacobian_scaled": float(jac(w_scaled))}


# --- printing ----------------------------------------------------------------------------

def _fmt(a, digits=3) -> str:
    return np.array2string(np.asarray(a), precision=digits, floatmode="fixed", suppress_small=True)


def _compare(label: str, computed, printed, digits: int) -> str:
    """The computed array, and a note naming every entry where the text's number differs."""
    computed, printed = np.asarray(computed), np.asarray(printed)
    lines = [f"{label}:", _fmt(computed, digits)]
    tol = 0.5 * 10.0 ** -digits + 1e-12
    wrong = np.argwhere(np.abs(np.round(computed, digits) - printed) > tol)
    if len(wrong) == 0:
        lines.append(f"  = the text's numbers (to {digits} decimals)")
    else:
        for idx in wrong:
            idx = tuple(int(i) for i in idx)
            lines.append(f"  ! the text prints {printed[idx]:g} at {idx if len(idx) > 1 else idx[0]}; "
                         f"the math gives {computed[idx]:.{digits + 1}f}")
    return "\n".join(lines)


def report() -> str:
    """The whole demo as text."""
    t, s, sc = three_tokens(), soft_lookup(), scaling()
    parts = [
        "qkv demo: softmax(Q Kᵀ / √d_k) V on the texts' worked examples",
        "",
        "1. Three tokens (S036 §5): X = [[1,0],[0,1],[1,1]], W_Q = W_K = W_V = I, d_k = 2",
        "Step A, scores Q Kᵀ:", _fmt(t["scores"]),
        "Step B, " + _compare("scaled by 1/√2", t["scaled"], THREE_TOKENS_PRINTED["scaled"], 3),
        "Step C, " + _compare("row-wise softmax (weights)", t["weights"], THREE_TOKENS_PRINTED["weights"], 3),
        f"  rows sum to {_fmt(t['weights'].sum(-1))}",
        "  (row 2: exp([0.707, 0.707, 1.414]) = [2.028, 2.028, 4.113], sum 8.169, so "
        "[0.248, 0.248, 0.503])",
        "Step D, " + _compare("output Y = W V", t["output"], THREE_TOKENS_PRINTED["output"], 3),
        "",
        "2. Soft dictionary lookup (S036 §2-3): keys cat, dog, fish; query [1, 0.05]; the text uses no 1/√d",
        _compare("scores K q", s["scores"], LOOKUP_PRINTED["scores"], 3),
        _compare("weights softmax(scores)", s["weights"], LOOKUP_PRINTED["weights"], 2),
        _compare("output y = w V", s["output"], LOOKUP_PRINTED["output"], 2),
        "  (exp([1, 0.905, 0.05]) = [2.718, 2.472, 1.051], sum 6.241)",
        f"With the 1/√d of scaled dot-product attention (d = 2): weights {_fmt(s['weights_scaled'])}, "
        f"output {_fmt(s['output_scaled'], 2)}",
        "",
        f"3. Why √d_k (S036 §7): one query, 8 random keys, unit-variance entries, d_k = {sc['d_k']}",
        f"std of q·k over 2000 samples: {sc['score_std']:.1f} (√d_k = {np.sqrt(sc['d_k']):.1f}); "
        f"after /√d_k: {sc['score_std_scaled']:.2f}",
        "raw scores:          " + _fmt(sc["raw"], 1),
        "weights, unscaled:   " + _fmt(sc["weights_unscaled"]),
        "weights, /√d_k:      " + _fmt(sc["weights_scaled"]),
        f"size of the softmax Jacobian Σ|diag(w) - w wᵀ|: unscaled {sc['jacobian_unscaled']:.2e}, "
        f"scaled {sc['jacobian_scaled']:.2e}",
        "Unscaled, the softmax is (nearly) one-hot and passes almost no gradient back.",
    ]
    return "\n".join(parts)


def plot(path: str) -> None:
    """Heatmaps: the 3-token weights, and 8x8 weights at d_k = 512 without and with 1/√d_k."""
    t = three_tokens()
    d_k = 512
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((8, d_k)), rng.standard_normal((8, d_k))  # 8 queries, 8 keys
    _, w_raw = attention(q, k, k, scale=1.0, return_weights=True, method="reference")
    _, w_scaled = attention(q, k, k, return_weights=True, method="reference")
    fig = figure(figsize=(14, 4.2), layout="constrained")
    axes = fig.subplots(1, 3)
    panels = [
        (t["weights"], "3-token example: weights", ["x0", "x1", "x2"]),
        (w_raw, f"d_k={d_k}, random q, k: softmax(q·k)", None),
        (w_scaled, f"d_k={d_k}, random q, k: softmax(q·k/√d_k)", None),
    ]
    for ax, (w, title, labels) in zip(axes, panels):
        im = ax.imshow(w, cmap="viridis", vmin=0, vmax=1, aspect="auto")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        labels = labels or [str(i) for i in range(w.shape[0])]
        ax.set_xticks(range(len(labels)), labels)
        ax.set_yticks(range(len(labels)), labels)
        for (i, j), val in np.ndenumerate(w):
            ax.text(j, i, f"{val:.2f}", ha="center", va="center", fontsize=8,
                    color="white" if val < 0.5 else "black")
    fig.colorbar(im, ax=axes, shrink=0.8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
