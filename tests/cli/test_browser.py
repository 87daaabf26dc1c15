"""``qkv explain``'s HTML in a real headless Chromium, driven over the DevTools protocol.

Chromium is started the way a user would start it (plus --remote-debugging-port) on the
file:// URL; the page must load with no console errors or exceptions, draw every head,
and react to real mouse events dispatched by the browser (Input.dispatchMouseEvent):
hovering a token focuses it, clicking a model-view thumbnail opens that head. A
screenshot is kept under the test's tmp dir and copied to ``artifacts/`` (git-ignored).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
if CHROMIUM is None:
    pytest.skip("headless Chromium is not installed (apt-get install chromium; .ci/run does it)",
                allow_module_level=True)
websocket = pytest.importorskip("websocket", reason="the browser test needs websocket-client (qkv[test])")

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


class DevTools:
    """A minimal DevTools-protocol client: commands by id, events kept in order."""

    def __init__(self, ws_url: str):
        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict] = []

    def send(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_for(self, method: str, timeout: float = 30) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for ev in self.events:
                if ev.get("method") == method:
                    return ev
            self.ws.settimeout(max(0.1, end - time.monotonic()))
            self.events.append(json.loads(self.ws.recv()))
        raise TimeoutError(method)

    def js(self, expression: str):
        res = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in res:
            raise AssertionError(f"page script failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    def mouse(self, kind: str, x: float, y: float, **extra) -> None:
        self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, **extra)

    def click(self, x: float, y: float) -> None:
        self.mouse("mouseMoved", x, y)
        self.mouse("mousePressed", x, y, button="left", clickCount=1)
        self.mouse("mouseReleased", x, y, button="left", clickCount=1)

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and browser log errors seen so far."""
        out = []
        for ev in self.events:
            m, p = ev.get("method"), ev.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
            elif m == "Runtime.exceptionThrown":
                out.append("exception: " + json.dumps(p["exceptionDetails"])[:500])
            elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append("log: " + p["entry"]["text"])
        return out


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium as a user starts it, plus a DevTools port chosen by Chromium itself."""
    profile = tmp_path_factory.mktemp("chromium-profile")
    proc = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--no-first-run", "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
         "--remote-debugging-port=0", "--window-size=1280,900", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        end = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > end:
                pytest.fail(f"chromium did not start (exit code {proc.poll()})")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = []
        while not pages:  # the first page target can show up a moment after the port
            if time.monotonic() > end:
                pytest.fail("chromium opened its DevTools port but no page")
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
                pages = [t for t in json.load(resp) if t["type"] == "page"]
            time.sleep(0.05)
        yield pages[0]["webSocketDebuggerUrl"]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _open(ws_url: str, path: Path) -> DevTools:
    dt = DevTools(ws_url)
    for domain in ("Page", "Runtime", "Log"):
        dt.send(f"{domain}.enable")
    dt.events.clear()
    dt.send("Page.navigate", url=path.resolve().as_uri())
    dt.wait_for("Page.loadEventFired")
    for _ in range(100):
        if dt.js("document.body && document.body.dataset.ready") == "1":
            break
        time.sleep(0.05)
    return dt


def _center(dt: DevTools, selector: str) -> tuple[float, float]:
    box = dt.js(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return null;"
                " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
                " return [r.x + r.width / 2, r.y + r.height / 2]; })()")
    assert box is not None, f"no element {selector}"
    return box[0], box[1]


@pytest.fixture(scope="module")
def explain_page(tmp_path_factory):
    pytest.importorskip("safetensors", reason="needs the models extra")
    pytest.importorskip("matplotlib", reason="needs the viz extra")
    from qkv.cli import main

    out = tmp_path_factory.mktemp("explain")
    assert main(["explain", "--out", str(out)]) == 0
    return out / "explain.html"


def test_explain_page_in_chromium(browser, explain_page, tmp_path):
    dt = _open(browser, explain_page)
    try:
        assert dt.js("document.body.dataset.ready") == "1", "the page script did not finish"
        n_tokens = dt.js("JSON.parse(document.getElementById('qkv-data').textContent).tokens.length")
        assert n_tokens == 16
        # every head drawn: 12 head chips and lines of 12 distinct heads in the head view,
        # 6 x 12 thumbnails (canvases with pixels) in the model view
        assert dt.js("document.querySelectorAll('#legend .head-chip').length") == 12
        assert dt.js("new Set([...document.querySelectorAll('line.attn')].map(l => l.dataset.h)).size") == 12
        assert dt.js("document.querySelectorAll('canvas.thumb').length") == 72
        assert dt.js("[...document.querySelectorAll('canvas.thumb')].every(c => c.width > 0 && "
                     "c.getContext('2d').getImageData(0, 0, c.width, c.height).data.some(v => v < 250))")
        assert dt.js("document.getElementById('notice').hidden") is True  # 16 tokens: no budget needed
        total = int(dt.js("document.body.dataset.lines"))
        assert total > 0 and dt.js("document.body.dataset.shown") == str(total)

        # hover the query token "it" (position 10) with a real mouse event
        it = 10
        assert dt.js(f"document.querySelector('g.tok.q[data-i=\"{it}\"] text').textContent") == "it"
        x, y = _center(dt, f'g.tok.q[data-i="{it}"] text')
        dt.mouse("mouseMoved", x, y)
        assert dt.js("document.body.dataset.focus") == f"q:{it}"
        shown = int(dt.js("document.body.dataset.shown"))
        assert 0 < shown < total
        visible = dt.js("[...document.querySelectorAll('line.attn')].filter(l => "
                        "getComputedStyle(l).display !== 'none').map(l => Number(l.dataset.i))")
        assert len(visible) == shown and set(visible) == {it}
        assert dt.js(f"document.querySelector('g.tok.q[data-i=\"{it}\"]').classList.contains('focus')")
        shaded = dt.js("[...document.querySelectorAll('g.tok.k rect')].filter(r => r.style.fill).length")
        assert shaded > 0
        assert "query \u201cit\u201d attends most to" in dt.js("document.getElementById('status').textContent")
        shot = dt.send("Page.captureScreenshot", format="png")["data"]
        import base64

        png = tmp_path / "explain-hover.png"
        png.write_bytes(base64.b64decode(shot))
        ARTIFACTS.mkdir(exist_ok=True)
        shutil.copy(png, ARTIFACTS / "explain-hover.png")

        # moving away restores every line
        dt.mouse("mouseMoved", 5, 5)
        assert dt.js("document.body.dataset.focus") == ""
        assert dt.js("document.body.dataset.shown") == str(total)

        # model view: click the thumbnail of layer 3, head 5 and it opens in the head view
        dt.click(*_center(dt, "#tab-model"))
        assert dt.js("document.body.dataset.view") == "model"
        dt.click(*_center(dt, 'canvas.thumb[data-layer="3"][data-head="5"]'))
        assert dt.js("document.body.dataset.view") == "head"
        assert dt.js("[document.body.dataset.layer, document.body.dataset.head]") == ["3", "5"]
        assert dt.js("document.getElementById('layer').value") == "3"
        assert dt.js("new Set([...document.querySelectorAll('line.attn')].map(l => l.dataset.h)).size") == 1

        assert dt.errors() == []
    finally:
        dt.ws.close()


def test_budgeted_page_shows_its_notice(browser, tmp_path):
    import qkv
    from qkv import viz

    rng = np.random.default_rng(0)
    att = qkv.softmax(rng.standard_normal((2, 3, 300, 300)) * 4).astype(np.float32)
    path = viz.html(att, [f"t{i}" for i in range(300)], tmp_path / "big.html", max_bytes=200_000)
    dt = _open(browser, path)
    try:
        assert dt.js("document.body.dataset.ready") == "1"
        assert dt.js("document.getElementById('notice').hidden") is False
        assert "Size budget applied" in dt.js("document.getElementById('notice').textContent")
        assert dt.js("document.querySelectorAll('canvas.thumb').length") == 6
        x, y = _center(dt, 'g.tok.k[data-i="7"] text')
        dt.mouse("mouseMoved", x, y)
        assert dt.js("document.body.dataset.focus") == "k:7"
        assert dt.js("[...document.querySelectorAll('line.attn')].filter(l => getComputedStyle(l).display "
                     "!== 'none').every(l => l.dataset.j === '7')")
        assert dt.errors() == []
    finally:
        dt.ws.close()
