"""Pictures of attention on plain NumPy arrays: static heatmaps and a self-contained HTML explorer.

- :func:`heatmap` ``(weights (T, T), tokens, path)``: one head as a heatmap (PNG or SVG);
- :func:`grid` ``(attentions (layers, heads, T, T), tokens, path)``: every head, layers × heads;
- :func:`html` ``(attentions, tokens, path)``: one HTML file (inline JS and CSS, no network)
  with a head view, a model view, layer and head selectors, and a size budget.

matplotlib (the ``viz`` extra) is imported only by the static pictures, when called.
"""
from .explorer import html
from .static import grid, heatmap

__all__ = ["heatmap", "grid", "html"]
