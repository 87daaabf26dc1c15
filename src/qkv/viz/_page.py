"""The CSS and JavaScript inlined into the explorer page written by :func:`qkv.viz.html`.

Plain DOM and SVG, no libraries. The page reads its data from the JSON script tag
``#qkv-data`` (see :func:`qkv.viz.explorer.pack` for the two encodings). For tests and
scripts it exposes its state on ``document.body.dataset``: ``ready`` once drawn,
``view`` ("head" or "model"), ``layer``, ``head`` ("all" or a number), ``focus`` (""
or "q:i" / "k:j" for the hovered query or key token).
"""

PAGE_CSS = r"""
:root { --fg: #1d2330; --muted: #667085; --bg: #fbfbfd; --line: #d0d5dd; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg); background: var(--bg); }
header { padding: 12px 20px 4px; border-bottom: 1px solid var(--line); background: #fff; position: sticky; top: 0; z-index: 2; }
h1 { font-size: 18px; margin: 0 0 8px; }
nav { display: flex; gap: 12px; align-items: center; flex-wrap: wrap; }
.tab { border: 1px solid var(--line); background: #fff; padding: 4px 12px; border-radius: 6px; cursor: pointer; font: inherit; }
.tab.active { background: var(--fg); color: #fff; border-color: var(--fg); }
select { font: inherit; padding: 2px 4px; }
.notice { background: #fff4e5; border: 1px solid #f5b971; padding: 6px 10px; border-radius: 6px; margin: 8px 0 4px; }
main { padding: 8px 20px 20px; }
.help { color: var(--muted); margin: 4px 0 8px; }
#legend { display: flex; gap: 6px; flex-wrap: wrap; margin-bottom: 6px; }
.chip { display: inline-flex; align-items: center; gap: 4px; font-size: 12px; padding: 1px 6px; border-radius: 10px; border: 1px solid var(--line); background: #fff; cursor: pointer; }
.chip i { width: 10px; height: 10px; border-radius: 50%; display: inline-block; }
.chip.off { opacity: 0.35; }
svg#lines { display: block; }
svg text { font-size: 13px; cursor: default; dominant-baseline: middle; }
svg rect.tokbg { fill: transparent; }
svg g.tok.focus text { font-weight: 700; }
svg g.tok.focus rect.tokbg { fill: #ffe08a; }
svg line.attn { stroke-linecap: round; }
svg line.attn.dim { display: none; }
#status { color: var(--fg); min-height: 1.4em; position: sticky; bottom: 0; background: var(--bg); padding: 4px 0; margin: 0; }
#thumbs { display: grid; gap: 6px; align-items: center; }
.thumb { width: 76px; height: 76px; image-rendering: pixelated; border: 1px solid var(--line); cursor: pointer; background: #fff; }
.thumb:hover { outline: 2px solid #3b6fd8; }
.thumb.current { outline: 2px solid #e8590c; }
.rowlabel, .collabel { font-size: 12px; color: var(--muted); text-align: center; }
"""

PAGE_JS = r"""
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("qkv-data").textContent);
  const tokens = D.tokens, T = tokens.length, L = D.layers, H = D.heads;
  const SVGNS = "http://www.w3.org/2000/svg";
  const MIN_SHOWN = 0.01;          // lines below this weight are not drawn
  const body = document.body;

  function bytes(b64) {
    const s = atob(b64), u = new Uint8Array(s.length);
    for (let i = 0; i < s.length; i++) u[i] = s.charCodeAt(i);
    return u;
  }
  // row(l, h, i) -> [[key j, weight], ...] for query token i of head (l, h)
  let row;
  if (D.mode === "full") {
    const w = new Float32Array(bytes(D.weights).buffer);
    row = function (l, h, i) {
      const o = ((l * H + h) * T + i) * T, r = [];
      for (let j = 0; j < T; j++) r.push([j, w[o + j]]);
      return r;
    };
  } else {
    const idx = new Uint16Array(bytes(D.index).buffer), val = bytes(D.values), k = D.k;
    row = function (l, h, i) {
      const o = ((l * H + h) * T + i) * k, r = [];
      for (let n = 0; n < k; n++) r.push([idx[o + n], val[o + n] / 255]);
      return r;
    };
  }
  function color(h) { return "hsl(" + Math.round(h * 360 / H) + ", 70%, 42%)"; }

  const state = { view: "head", layer: 0, heads: new Set(), focus: "" };
  for (let h = 0; h < H; h++) state.heads.add(h);

  // --- controls ---------------------------------------------------------------------
  const layerSel = document.getElementById("layer"), headSel = document.getElementById("head");
  for (let l = 0; l < L; l++) layerSel.add(new Option(String(l), String(l)));
  headSel.add(new Option("all", "all"));
  for (let h = 0; h < H; h++) headSel.add(new Option(String(h), String(h)));
  layerSel.addEventListener("change", function () { state.layer = Number(layerSel.value); drawHeadView(); });
  headSel.addEventListener("change", function () { setHeads(headSel.value); drawHeadView(); });
  function setHeads(v) {
    state.heads.clear();
    if (v === "all") { for (let h = 0; h < H; h++) state.heads.add(h); }
    else state.heads.add(Number(v));
  }
  document.getElementById("tab-head").addEventListener("click", function () { show("head"); });
  document.getElementById("tab-model").addEventListener("click", function () { show("model"); });
  function show(view) {
    state.view = view;
    document.getElementById("head-view").hidden = view !== "head";
    document.getElementById("model-view").hidden = view !== "model";
    document.getElementById("tab-head").classList.toggle("active", view === "head");
    document.getElementById("tab-model").classList.toggle("active", view === "model");
    body.dataset.view = view;
    if (view === "model") markCurrent();
  }
  if (D.notice) {
    const n = document.getElementById("notice");
    n.textContent = D.notice;
    n.hidden = false;
  }

  // --- head view ---------------------------------------------------------------------
  const svg = document.getElementById("lines");
  const ROW = 22, TOP = 14, XL = 200, XR = 420, WIDTH = 620;
  let lines = [], qToks = [], kToks = [];

  function tokenGroup(text, x, y, anchor, side, i) {
    const g = document.createElementNS(SVGNS, "g");
    g.setAttribute("class", "tok " + side);
    g.dataset.side = side;
    g.dataset.i = String(i);
    const bg = document.createElementNS(SVGNS, "rect");
    bg.setAttribute("class", "tokbg");
    bg.setAttribute("x", anchor === "end" ? x - 150 : x);
    bg.setAttribute("y", y - ROW / 2 + 1);
    bg.setAttribute("width", 150);
    bg.setAttribute("height", ROW - 2);
    bg.setAttribute("rx", 4);
    const t = document.createElementNS(SVGNS, "text");
    t.setAttribute("x", anchor === "end" ? x - 6 : x + 6);
    t.setAttribute("y", y);
    t.setAttribute("text-anchor", anchor);
    t.textContent = text;
    g.appendChild(bg);
    g.appendChild(t);
    g.addEventListener("mouseenter", function () { focus(side, i); });
    g.addEventListener("mouseleave", function () { focus("", -1); });
    return g;
  }

  function drawHeadView() {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    svg.setAttribute("width", WIDTH);
    svg.setAttribute("height", TOP * 2 + T * ROW);
    lines = []; qToks = []; kToks = [];
    const layerG = document.createElementNS(SVGNS, "g");
    svg.appendChild(layerG);
    const heads = Array.from(state.heads).sort(function (a, b) { return a - b; });
    const alpha = heads.length > 1 ? 0.9 : 1.0;
    for (const h of heads) {
      for (let i = 0; i < T; i++) {
        for (const [j, w] of row(state.layer, h, i)) {
          if (w < MIN_SHOWN) continue;
          const ln = document.createElementNS(SVGNS, "line");
          ln.setAttribute("class", "attn");
          ln.setAttribute("x1", XL); ln.setAttribute("y1", TOP + (i + 0.5) * ROW);
          ln.setAttribute("x2", XR); ln.setAttribute("y2", TOP + (j + 0.5) * ROW);
          ln.setAttribute("stroke", color(h));
          ln.setAttribute("stroke-opacity", (alpha * w).toFixed(3));
          ln.setAttribute("stroke-width", (1 + 3 * w).toFixed(2));
          ln.dataset.h = String(h); ln.dataset.i = String(i); ln.dataset.j = String(j);
          ln.dataset.w = w.toFixed(4);
          layerG.appendChild(ln);
          lines.push(ln);
        }
      }
    }
    for (let i = 0; i < T; i++) {
      const y = TOP + (i + 0.5) * ROW;
      const q = tokenGroup(tokens[i], XL, y, "end", "q", i);
      const k = tokenGroup(tokens[i], XR, y, "start", "k", i);
      svg.appendChild(q); svg.appendChild(k);
      qToks.push(q); kToks.push(k);
    }
    drawLegend(heads);
    body.dataset.layer = String(state.layer);
    body.dataset.head = heads.length === H ? "all" : heads.join(",");
    body.dataset.lines = String(lines.length);
    layerSel.value = String(state.layer);
    headSel.value = heads.length === 1 ? String(heads[0]) : "all";
    focus("", -1);
  }

  function drawLegend(heads) {
    const legend = document.getElementById("legend");
    while (legend.firstChild) legend.removeChild(legend.firstChild);
    for (const h of heads) {
      const c = document.createElement("span");
      c.className = "chip head-chip";
      c.dataset.h = String(h);
      const dot = document.createElement("i");
      dot.style.background = color(h);
      c.appendChild(dot);
      c.appendChild(document.createTextNode("head " + h));
      c.title = "show only head " + h + " (click again for all)";
      c.addEventListener("click", function () {
        setHeads(state.heads.size === 1 && state.heads.has(h) ? "all" : String(h));
        drawHeadView();
      });
      legend.appendChild(c);
    }
  }

  function focus(side, i) {
    state.focus = side ? side + ":" + i : "";
    body.dataset.focus = state.focus;
    const other = side === "q" ? kToks : qToks;
    for (const g of qToks.concat(kToks)) {
      g.classList.remove("focus");
      g.querySelector("rect").style.fill = "";
    }
    let shown = 0;
    const mass = new Float32Array(T);
    for (const ln of lines) {
      const mine = side === "q" ? Number(ln.dataset.i) : Number(ln.dataset.j);
      const keep = !side || mine === i;
      ln.classList.toggle("dim", !keep);
      if (keep) {
        shown++;
        if (side) mass[side === "q" ? Number(ln.dataset.j) : Number(ln.dataset.i)] += Number(ln.dataset.w);
      }
    }
    body.dataset.shown = String(shown);
    const status = document.getElementById("status");
    if (!side) { status.textContent = "\u00a0"; return; }
    (side === "q" ? qToks : kToks)[i].classList.add("focus");
    const n = state.heads.size;
    const ranked = [];
    for (let j = 0; j < T; j++) {
      const m = mass[j] / n;
      if (m > 0) other[j].querySelector("rect").style.fill = "rgba(59, 111, 216, " + Math.min(0.85, m).toFixed(3) + ")";
      ranked.push([m, j]);
    }
    ranked.sort(function (a, b) { return b[0] - a[0]; });
    const top = ranked.slice(0, 3).filter(function (r) { return r[0] > 0; })
      .map(function (r) { return tokens[r[1]] + " " + r[0].toFixed(2); }).join(", ");
    status.textContent = (side === "q" ? "query \u201c" + tokens[i] + "\u201d attends most to: "
                                       : "key \u201c" + tokens[i] + "\u201d is attended most by: ")
      + (top || "(nothing above " + MIN_SHOWN + ")") + "  (layer " + state.layer + ", "
      + (n === 1 ? "head " + Array.from(state.heads)[0]
                 : "mean over " + (n === H ? "all " + H + " heads" : n + " heads")) + ")";
  }

  // --- model view ----------------------------------------------------------------------
  const thumbs = document.getElementById("thumbs");
  const N = Math.min(T, 96);  // thumbnail resolution: T x T pooled (by max) to N x N
  function drawThumb(canvas, l, h) {
    canvas.width = N; canvas.height = N;
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(N, N);
    const cell = new Float32Array(N * N);
    for (let i = 0; i < T; i++) {
      const ri = Math.floor(i * N / T);
      for (const [j, w] of row(l, h, i)) {
        const c = ri * N + Math.floor(j * N / T);
        if (w > cell[c]) cell[c] = w;
      }
    }
    let mx = 1e-9;
    for (let c = 0; c < cell.length; c++) if (cell[c] > mx) mx = cell[c];
    for (let c = 0; c < cell.length; c++) {
      const v = Math.sqrt(cell[c] / mx);   // sqrt: faint weights stay visible
      img.data[4 * c] = Math.round(255 - 220 * v);
      img.data[4 * c + 1] = Math.round(255 - 170 * v);
      img.data[4 * c + 2] = Math.round(255 - 60 * v);
      img.data[4 * c + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
  }
  function drawModelView() {
    thumbs.style.gridTemplateColumns = "56px repeat(" + H + ", 80px)";
    thumbs.appendChild(document.createElement("span"));
    for (let h = 0; h < H; h++) {
      const s = document.createElement("span");
      s.className = "collabel"; s.textContent = "head " + h;
      thumbs.appendChild(s);
    }
    for (let l = 0; l < L; l++) {
      const s = document.createElement("span");
      s.className = "rowlabel"; s.textContent = "layer " + l;
      thumbs.appendChild(s);
      for (let h = 0; h < H; h++) {
        const c = document.createElement("canvas");
        c.className = "thumb";
        c.dataset.layer = String(l); c.dataset.head = String(h);
        c.title = "layer " + l + ", head " + h + ": click to open";
        drawThumb(c, l, h);
        c.addEventListener("click", function () {
          state.layer = l; setHeads(String(h)); drawHeadView(); show("head");
        });
        thumbs.appendChild(c);
      }
    }
  }
  function markCurrent() {
    for (const c of thumbs.querySelectorAll(".thumb")) {
      c.classList.toggle("current", Number(c.dataset.layer) === state.layer && state.heads.size === 1
                                    && state.heads.has(Number(c.dataset.head)));
    }
  }

  drawHeadView();
  drawModelView();
  show("head");
  body.dataset.ready = "1";
})();
"""
