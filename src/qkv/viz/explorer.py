"""``html(attentions, tokens, path)``: one self-contained HTML file to explore every head.

The page has no outside references (inline CSS and JavaScript, data inside the file), so
it opens from ``file://`` with no network. Views:

- **head view**: the tokens in two columns, queries left and keys right, joined by lines
  whose opacity is the weight, one colour per head; hover a token to keep only its lines
  and shade the tokens on the other side by weight;
- **model view**: all layers × heads as thumbnails (one heatmap each); click one to open
  it in the head view;
- a layer selector and a head selector (one head or all).

**Size budget.** The weights travel as base64 inside the page. Dense float32 weights cost
``layers · heads · T² · 4 · 4/3`` characters; above ``max_bytes`` (default 4 MB, about
T = 100 for 6 × 12 heads) the file keeps, for every query row, only its ``k`` largest
weights, ``k = (3/4 · max_bytes) // (layers · heads · T · 3)``, as uint16 key indices and uint8 values (``round(w · 255)``, error <= 1/510), and the
page shows a notice saying so.
"""
from __future__ import annotations

import base64
import html as html_lib
import json
from pathlib import Path

import numpy as np

from ..errors import ShapeError
from ._page import PAGE_CSS, PAGE_JS
from .static import check_weights

DEFAULT_MAX_BYTES = 4_000_000


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def _b64_size(n: int) -> int:
    """Characters of base64 for n bytes."""
    return 4 * ((n + 2) // 3)


def pack(attentions: np.ndarray, max_bytes: int = DEFAULT_MAX_BYTES) -> dict:
    """The page's data: all weights as float32, or top-k per row quantised, with a notice."""
    n_layers, n_heads, t, _ = attentions.shape
    data = {"layers": n_layers, "heads": n_heads}
    if _b64_size(n_layers * n_heads * t * t * 4) <= max_bytes:
        data.update(mode="full", weights=_b64(attentions.astype("<f4")), notice="")
        return data
    if t > 65535:
        raise ShapeError(f"attentions must have T <= 65535 tokens for the HTML explorer; got {t}")
    k = int(max(1, min(t, (max_bytes * 3 // 4) // (n_layers * n_heads * t * 3))))
    # The k largest weights of every row, largest first: (L, H, T, T) -> (L, H, T, k).
    idx = np.argpartition(-attentions, k - 1, axis=-1)[..., :k]
    val = np.take_along_axis(attentions, idx, axis=-1)
    order = np.argsort(-val, axis=-1, kind="stable")
    idx = np.take_along_axis(idx, order, axis=-1)
    val = np.take_along_axis(val, order, axis=-1)
    kept = float(val.sum(-1).mean() / max(attentions.sum(-1).mean(), 1e-12))
    q = np.clip(np.rint(val * 255), 0, 255).astype(np.uint8)
    data.update(mode="topk", k=k, index=_b64(idx.astype("<u2")), values=_b64(q),
                notice=(f"Size budget applied: {t} tokens × {n_layers} layers × {n_heads} heads is more "
                        f"than {max_bytes / 1e6:.1f} MB of weights, so this file keeps the top {k} of "
                        f"{t} keys for each query row ({kept:.0%} of the attention mass on average), "
                        f"quantised to 8 bits (error at most 0.002). Weights not kept show as 0."))
    return data


def html(attentions, tokens, path, *, title: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Write the explorer for ``attentions (layers, heads, T, T)`` over ``tokens`` (T strings).

    Row i of ``attentions[l, h]`` is how query token i spreads its attention over the keys.
    Returns the path written (one file, no other files needed).
    """
    attentions, tokens = check_weights(attentions, tokens, 4, "(layers, heads, T, T)")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ShapeError(f"max_bytes must be a positive int; got {max_bytes!r}")
    data = pack(attentions, max_bytes)
    data["tokens"] = tokens
    data["title"] = title or "qkv attention explorer"
    # "<" as \u003c inside the JSON: no token can close the <script> or open a comment in it
    payload = json.dumps(data, ensure_ascii=True).replace("<", "\\u003c")
    page = PAGE_TEMPLATE.format(title=html_lib.escape(data["title"]), css=PAGE_CSS, js=PAGE_JS,
                                data=payload)
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path


PAGE_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{css}</style>
</head>
<body>
<header>
  <h1>{title}</h1>
  <nav>
    <button id="tab-head" class="tab active" type="button">Head view</button>
    <button id="tab-model" class="tab" type="button">Model view</button>
    <label>layer <select id="layer"></select></label>
    <label>head <select id="head"></select></label>
  </nav>
  <p id="notice" class="notice" hidden></p>
</header>
<main>
  <section id="head-view">
    <p class="help">Queries on the left attend to keys on the right; line opacity is the weight.
       Hover a token to keep only its lines.</p>
    <div id="legend"></div>
    <svg id="lines" xmlns="http://www.w3.org/2000/svg"></svg>
    <p id="status">&nbsp;</p>
  </section>
  <section id="model-view" hidden>
    <p class="help">Every head of every layer (rows: layers, columns: heads); each thumbnail is its
       weight matrix, queries down, keys across. Click one to open it.</p>
    <div id="thumbs"></div>
  </section>
</main>
<script type="application/json" id="qkv-data">{data}</script>
<script>{js}</script>
</body>
</html>
"""
