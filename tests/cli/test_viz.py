"""qkv.viz: static pictures (PNG/SVG) and the self-contained HTML explorer's file and data."""
from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest

import qkv
from qkv import viz
from qkv.viz.explorer import pack


def _attn(layers=2, heads=3, t=5, seed=0):
    rng = np.random.default_rng(seed)
    return qkv.softmax(rng.standard_normal((layers, heads, t, t)) * 3).astype(np.float32)


def _tokens(t):
    return [f"tok{i}" for i in range(t)]


def _page_data(path) -> dict:
    text = path.read_text(encoding="utf-8")
    m = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', text, re.S)
    assert m, "the page must carry its data in #qkv-data"
    return json.loads(m.group(1))


# --- static pictures ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mpl():
    return pytest.importorskip("matplotlib", reason="the static pictures need the viz extra (matplotlib)")


@pytest.mark.parametrize("ext", ["png", "svg"])
def test_heatmap_and_grid_write_by_extension(tmp_path, mpl, ext):
    w = _attn()
    one = viz.heatmap(w[1, 2], _tokens(5), tmp_path / f"one.{ext}", title="layer 1 head 2")
    grid = viz.grid(w, _tokens(5), tmp_path / f"grid.{ext}")
    also_grid = viz.heatmap(w, _tokens(5), tmp_path / f"grid2.{ext}")  # 4-D: drawn as the grid
    for p in (one, grid, also_grid):
        head = p.read_bytes()[:200]
        assert head.startswith(b"\x89PNG") if ext == "png" else b"<svg" in p.read_bytes()[:2000]


def test_static_pictures_reject_bad_input(tmp_path, mpl):
    w = _attn()
    with pytest.raises(qkv.ShapeError, match=r"path must end in \.png or \.svg"):
        viz.heatmap(w[0, 0], _tokens(5), tmp_path / "x.jpg")
    with pytest.raises(qkv.ShapeError, match=r"weights must end in \(T, T\) = \(4, 4\)"):
        viz.heatmap(w[0, 0], _tokens(4), tmp_path / "x.png")
    with pytest.raises(qkv.ShapeError, match=r"weights must have shape \(layers, heads, T, T\)"):
        viz.grid(w[0], _tokens(5), tmp_path / "x.png")
    with pytest.raises(qkv.ShapeError, match="tokens must be a list of strings"):
        viz.heatmap(w[0, 0], "abcde", tmp_path / "x.png")
    bad = w[0, 0].copy()
    bad[0, 0] = np.nan
    with pytest.raises(qkv.ShapeError, match="finite"):
        viz.heatmap(bad, _tokens(5), tmp_path / "x.png")


def test_static_pictures_draw_dollar_tokens_literally(tmp_path, mpl):
    tokens = ["$$", "$x$", "$\\frac$", "a_b", "^"]  # mathtext would fail on the 1st and 3rd
    w = _attn()
    viz.heatmap(w[0, 0], tokens, tmp_path / "one.png")
    viz.grid(w, tokens, tmp_path / "grid.png")
    assert viz.static._labels(["$x$"]) == [r"\$x\$"]


# --- the HTML explorer --------------------------------------------------------------------------

def test_html_is_one_self_contained_file(tmp_path):
    path = viz.html(_attn(), _tokens(5), tmp_path / "page.html", title="a <test>")
    assert list(tmp_path.iterdir()) == [path]
    text = path.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>") and "<title>a &lt;test&gt;</title>" in text
    # nothing fetched from anywhere: no external scripts, styles, images, fonts or imports
    assert not re.search(r"<(script|link|img|iframe)[^>]*\s(src|href)=", text)
    assert "@import" not in text and "url(" not in text
    urls = set(re.findall(r"https?://[^\s\"')]+", text))
    assert urls <= {"http://www.w3.org/2000/svg"}, urls  # the SVG namespace is a name, not a fetch


def test_html_full_mode_keeps_every_weight_exactly(tmp_path):
    w = _attn(3, 4, 7)
    data = _page_data(viz.html(w, _tokens(7), tmp_path / "p.html"))
    assert data["mode"] == "full" and data["notice"] == ""
    assert (data["layers"], data["heads"], data["tokens"]) == (3, 4, _tokens(7))
    got = np.frombuffer(base64.b64decode(data["weights"]), dtype="<f4").reshape(w.shape)
    np.testing.assert_array_equal(got, w)


def test_html_size_budget_keeps_top_k_with_a_notice(tmp_path):
    w = _attn(2, 3, 40, seed=1)
    path = viz.html(w, _tokens(40), tmp_path / "p.html", max_bytes=20_000)
    data = _page_data(path)
    k = (20_000 * 3 // 4) // (2 * 3 * 40 * 3)
    assert data["mode"] == "topk" and data["k"] == k == 20
    assert "Size budget applied" in data["notice"] and f"top {k} of 40 keys" in data["notice"]
    idx = np.frombuffer(base64.b64decode(data["index"]), dtype="<u2").reshape(2, 3, 40, k)
    val = np.frombuffer(base64.b64decode(data["values"]), dtype=np.uint8).reshape(2, 3, 40, k) / 255
    want = -np.sort(-w, axis=-1)[..., :k]
    np.testing.assert_allclose(val, want, atol=1 / 510 + 1e-7)
    np.testing.assert_allclose(np.take_along_axis(w, idx.astype(np.int64), -1), want, atol=1e-7)
    assert len(path.read_text()) < 20_000 + 30_000  # data within budget, plus the page itself


def test_html_tokens_cannot_break_out_of_the_page(tmp_path):
    tokens = ["</script><script>alert(1)</script>", "<!--<script>", "&amp;", '"q"', "ok"]
    path = viz.html(_attn(1, 1, 5), tokens, tmp_path / "p.html")
    text = path.read_text(encoding="utf-8")
    assert text.count("</script>") == 2  # the data tag's and the code's, nothing from the tokens
    assert "<!--" not in text and text.count("<script") == 2
    assert _page_data(path)["tokens"] == tokens


def test_html_rejects_bad_input(tmp_path):
    with pytest.raises(qkv.ShapeError, match=r"\(layers, heads, T, T\)"):
        viz.html(_attn()[0], _tokens(5), tmp_path / "p.html")
    with pytest.raises(qkv.ShapeError, match="max_bytes"):
        viz.html(_attn(), _tokens(5), tmp_path / "p.html", max_bytes=0)


def test_pack_chooses_by_size():
    w = _attn(1, 1, 10)
    assert pack(w, max_bytes=10_000)["mode"] == "full"
    small = pack(w, max_bytes=100)
    assert small["mode"] == "topk" and small["k"] == 2


def test_importing_costs_no_optional_dependency():
    import subprocess
    import sys

    code = ("import sys, qkv.viz, qkv.models, qkv.experiments.explain; "
            "print(sorted(m for m in ('matplotlib', 'safetensors', 'tokenizers', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
