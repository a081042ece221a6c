"""The pack in ComfyUI's real frontend, driven by headless Chromium.

Starts the shared headless ComfyUI (tests/e2e/conftest.py), opens its web UI
(the comfyui-frontend-package ComfyUI serves) in Chromium through Playwright,
and checks what a user sees:

- both example workflows load with every node type known and turn into
  exactly the API-format JSON shipped beside them;
- the SD1.5 example, shrunk to 64 px / 2 steps / warmup ``2x64x64``, runs:
  the Compile UNet and Warmup Shapes nodes get a drawn badge with the backend
  and state, Warmup Shapes shows live progress text ("shape 1/1, 2x64x64,
  0.3 s"), /history holds the same facts, and the browser logs no errors;
- asking for the triton backend (not in this release) falls back visibly: a
  ``fallback`` badge and a toast with the reason and the fix.

Screenshots go to ``$UNET_COMPILER_ARTIFACTS/browser`` (default
``tests/e2e/_artifacts/browser``). Skips with one line when Playwright,
Chromium or ComfyUI's frontend package is missing. Chromium: Debian's
``apt-get install chromium`` (/usr/bin/chromium), or ``UNET_COMPILER_CHROMIUM``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

PACK_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = PACK_ROOT / "example_workflows"
ARTIFACTS = Path(os.environ.get("UNET_COMPILER_ARTIFACTS") or (PACK_ROOT / "tests" / "e2e" / "_artifacts")) / "browser"
COMPILE, WARMUP, SELECT = "11", "12", "10"  # node ids in example_workflows/*
PROMPT_TIMEOUT_S = 900
# the shape test_comfyui_server.py warms too: in one session the second compile is a cache hit
SHAPE = "2x64x64"
BADGE_COLORS = {"compiled": (0x2E, 0x7D, 0x32), "planned": (0x15, 0x65, 0xC0), "fallback": (0xC6, 0x28, 0x28)}  # web/unet_compiler.js COLORS


def _chromium() -> str | None:
    env = os.environ.get("UNET_COMPILER_CHROMIUM")
    if env:
        return env if Path(env).is_file() else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _missing() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "browser test needs Playwright: pip install playwright (no browser download: it drives the system Chromium)"
    if _chromium() is None:
        return "browser test needs Chromium: apt-get install -y chromium (or set UNET_COMPILER_CHROMIUM)"
    if importlib.util.find_spec("comfyui_frontend_package") is None:
        return "browser test needs ComfyUI's frontend: pip install -r ComfyUI/requirements.txt (comfyui-frontend-package)"
    return None


if _missing():
    pytest.skip(_missing(), allow_module_level=True)


# Runs once in the page: records the pack's events, node progress texts and
# execution status so the test can assert on what the frontend received.
_COLLECT_JS = """() => {
  const { api } = window.comfyAPI.api;
  const uc = (window.__uc = { events: [], texts: [], status: [] });
  for (const name of ["compile", "warmup", "fallback"])
    api.addEventListener("unet_compiler." + name, (e) => uc.events.push([name, e.detail]));
  api.addEventListener("progress_text", (e) => uc.texts.push(e.detail));
  for (const name of ["execution_success", "execution_error", "execution_interrupted"])
    api.addEventListener(name, (e) => uc.status.push([name, e.detail]));
}"""

# The badge texts node.drawBadges() paints, and the node's live progress text.
_NODE_STATE_JS = """(id) => {
  const node = window.comfyAPI.app.app.graph.getNodeById(Number(id));
  if (!node) return null;
  const badges = (node.badges ?? []).map((b) => (typeof b === "function" ? b() : b));
  const preview = (node.widgets ?? []).find((w) => w.name === "$$node-text-preview");
  return { badges: badges.filter((b) => b?.visible).map((b) => b.text), state: node.unetCompiler ?? null,
           progress: preview ? preview.value : null };
}"""

# Screen rectangle (CSS px) of a node's badge row, from the canvas transform.
_BADGE_RECT_JS = """(id) => {
  const app = window.comfyAPI.app.app, node = app.graph.getNodeById(Number(id));
  const ds = app.canvas.ds, r = app.canvas.canvas.getBoundingClientRect();
  const th = LiteGraph.NODE_TITLE_HEIGHT;
  const x0 = (node.pos[0] + ds.offset[0]) * ds.scale + r.left;
  const y0 = (node.pos[1] - th - 26 + ds.offset[1]) * ds.scale + r.top;
  return { x: x0, y: y0, width: node.size[0] * ds.scale, height: 26 * ds.scale };
}"""


def _post_setting(server, key, value):
    req = urllib.request.Request(f"{server.url}/api/settings/{key}", data=json.dumps(value).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(req, timeout=30).read()


def _load_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


class Page:
    """A Chromium tab on the server's UI, with console errors recorded."""

    def __init__(self, pw, server):
        self.browser = pw.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        self.page = self.browser.new_page(viewport={"width": 1600, "height": 1000})
        self.errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(
            f"console.error: {m.text} ({m.location.get('url', '')})"))
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.server = server

    def open(self):
        self.page.goto(self.server.url)
        self.page.wait_for_function(
            "() => window.comfyAPI?.app?.app?.graph && window.comfyAPI.app.app.extensions"
            "?.some((e) => e.name === 'UNetCompiler.Feedback')"
            " && window.LiteGraph?.registered_node_types?.UNetCompiler_CompileUNet", timeout=120_000)
        self.page.evaluate(_COLLECT_JS)
        # a fresh server answers 404 for optional files (user.css, favicon, empty user
        # data); any other error while the UI starts is a failure
        startup = [e for e in self.errors if "Failed to load resource" not in e or "unet" in e.lower()]
        assert not startup, "browser errors while the UI started:\n" + "\n".join(startup)
        self.errors.clear()

    def js(self, code, arg=None):
        return self.page.evaluate(code, arg)

    def shot(self, name):
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / name
        self.page.screenshot(path=str(path))
        return path

    def node(self, node_id):
        return self.js(_NODE_STATE_JS, node_id)

    def close(self):
        self.browser.close()


@pytest.fixture(scope="module")
def browser_page(comfy_server):
    from playwright.sync_api import sync_playwright

    info = comfy_server.object_info()
    if "UNetCompiler_CompileUNet" not in info:
        pytest.fail("the pack's nodes are not in /object_info:\n" + comfy_server.pack_import_report(), pytrace=False)
    # a fresh user directory would open the template browser and warn about
    # the example's (absent) model download: neither is what is tested here
    _post_setting(comfy_server, "Comfy.TutorialCompleted", True)
    _post_setting(comfy_server, "Comfy.Workflow.ShowMissingModelsWarning", False)
    _post_setting(comfy_server, "Comfy.Minimap.Visible", False)  # keeps screenshots uncluttered
    with sync_playwright() as pw:
        page = Page(pw, comfy_server)
        try:
            page.open()
            yield page
        finally:
            page.close()


def test_example_workflows_load_and_match_api(browser_page):
    """Each UI example loads with every node type registered and converts to
    the API JSON shipped beside it (same nodes, inputs and links)."""
    page = browser_page
    for ui in sorted(EXAMPLES.glob("*.json")):
        api = _load_json(EXAMPLES / "api" / f"{ui.stem}_api.json")
        unknown = page.js("(wf) => wf.nodes.map((n) => n.type).filter((t) => !LiteGraph.registered_node_types[t])",
                          _load_json(ui))
        assert not unknown, f"{ui.name}: node types the frontend does not know: {unknown}"
        out = page.js("""async (wf) => {
            const app = window.comfyAPI.app.app;
            await app.loadGraphData(wf, true, true, "example");
            return (await app.graphToPrompt()).output;
        }""", _load_json(ui))
        got = {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in out.items()}
        want = {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in api.items()}
        assert got == want, f"{ui.name} and api/{ui.stem}_api.json disagree:\nUI  -> {got}\nAPI -> {want}"
        page.shot(f"01_loaded_{ui.stem}.png")
        # the frontend validates a loaded workflow and alerts in a toast or dialog, not the console
        alerts = page.js("() => [...document.querySelectorAll('.p-toast-message, .p-dialog')]"
                         ".map((e) => e.innerText.trim()).filter(Boolean)")
        assert not alerts, f"loading {ui.name} raised: {alerts}"
    assert not page.errors, "browser errors while loading the examples:\n" + "\n".join(page.errors)


def _queue_and_wait(page, n_done_before: int, timeout=PROMPT_TIMEOUT_S, on_poll=None):
    page.js("async () => { await window.comfyAPI.app.app.queuePrompt(0, 1); }")
    deadline = time.time() + timeout
    while True:
        status = page.js("() => window.__uc.status")
        if len(status) > n_done_before:
            return status[-1]
        page.server.check_alive()
        if on_poll is not None:
            on_poll()
        assert time.time() < deadline, f"prompt did not finish in {timeout} s; server log:\n{page.server.log_tail()}"
        time.sleep(0.5)


def _badge_pixels(page, node_id, rgb) -> int:
    """How many pixels of the badge colour the canvas shows in the node's badge row."""
    import io

    import numpy as np
    from PIL import Image

    rect = page.js(_BADGE_RECT_JS, node_id)
    png = page.page.screenshot(clip=rect)
    img = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    return int((np.abs(img - np.array(rgb)).sum(axis=-1) < 24).sum())


def _history(server, prompt_id) -> dict:
    return server.get_json(f"/history/{prompt_id}")[prompt_id]


def _ui_text(entry, node_id) -> str:
    text = ((entry.get("outputs") or {}).get(node_id) or {}).get("text") or []
    return "\n".join(text) if isinstance(text, list) else str(text)


def test_badge_progress_and_fallback_toast(browser_page, sd15_checkpoint):
    page = browser_page
    server = page.server
    wf = _load_json(EXAMPLES / "sd15_compile_unet.json")
    t0 = time.time()
    page.js("""async ([wf, ckpt, shape]) => {
        const app = window.comfyAPI.app.app;
        await app.loadGraphData(wf, true, true, "browser-test");
        const set = (id, name, value) => {
            const w = app.graph.getNodeById(id).widgets.find((w) => w.name === name);
            w.value = value; w.callback?.(value);
        };
        set(4, "ckpt_name", ckpt);
        set(5, "width", 64); set(5, "height", 64);
        set(3, "steps", 2); set(3, "control_after_generate", "fixed");
        set(12, "shapes", shape);  // cfg 7: cond + uncond run as one batch of 2
        set(12, "background", false);  // the foreground warmup's badge flow (on by default)
        set(9, "filename_prefix", "browser_test");
        // a fixed view, so the badge rows are on screen wherever the example was saved
        app.canvas.ds.scale = 0.8; app.canvas.ds.offset = [80, 110];
        app.graph.setDirtyCanvas(true, true);
    }""", [wf, sd15_checkpoint.name, SHAPE])
    errors_before = len(page.errors)

    shots = {}

    def watch():
        # one screenshot while Warmup Shapes is visibly compiling
        if "compiling" not in shots:
            state = page.node(WARMUP)
            if state and (state["progress"] or "").find("compiling") >= 0:
                shots["compiling"] = page.shot("02_warmup_compiling.png")

    status = _queue_and_wait(page, 0, on_poll=watch)
    page.js("() => window.comfyAPI.app.app.graph.setDirtyCanvas(true, true)")
    time.sleep(1.0)  # one animation frame for the badges
    page.shot("03_compiled.png")
    secs = time.time() - t0
    events = page.js("() => window.__uc.events")
    texts = [t["text"] for t in page.js("() => window.__uc.texts") if str(t.get("nodeId")) == WARMUP]
    assert status[0] == "execution_success", f"prompt failed: {status}\nserver log:\n{server.log_tail(4000)}"
    print(f"\n[browser] compile + warmup {SHAPE} + 2 steps at 64 px in the UI: {secs:.1f} s; "
          f"screenshots in {ARTIFACTS}")

    compile_ev = [e for n, e in events if n == "compile"]
    assert len(compile_ev) == 1 and compile_ev[0]["node_id"] == COMPILE, events
    ev = compile_ev[0]
    assert ev["state"] == "planned" and ev["backend"] not in ("eager", None), (
        f"Compile UNet did not compile here: {ev}")
    backend = ev["backend"]

    phases = [(e["phase"], e["state"]) for n, e in events if n == "warmup"]
    assert phases == [("start", "compiling"), ("shape", "compiling"), ("end", "compiled")], events
    shape_ev = [e for n, e in events if n == "warmup" and e["phase"] == "shape"][0]
    assert (shape_ev["index"], shape_ev["total"], shape_ev["shape"]) == (1, 1, SHAPE), shape_ev
    # live progress text on the node: the running label, then "shape 1/1, 2x64x64, 0.3 s"
    assert any("compiling…" in t for t in texts), f"no live 'compiling…' text on Warmup Shapes: {texts}"
    # ...refreshed with the seconds spent while a long compile runs, so it never looks hung
    assert any(re.search(r"compiling… \d+ s$", t) for t in texts), f"no ticking seconds on Warmup Shapes: {texts}"
    assert any(re.fullmatch(rf"shape 1/1, {SHAPE}, \d+\.\d s", t) for t in texts), texts
    assert not [e for n, e in events if n == "fallback"], events

    # Compile UNet says what it planned (blue), Warmup Shapes what compiled and ran (green)
    for node_id, said, color in ((COMPILE, "planned", "blue"), (WARMUP, "compiled", "green")):
        state = page.node(node_id)
        assert any(b.startswith(f"{backend} · {said}") for b in state["badges"]), f"node {node_id}: {state}"
        assert _badge_pixels(page, node_id, BADGE_COLORS[said]) > 100, (
            f"node {node_id}: no {color} badge drawn above the node (see {ARTIFACTS / '03_compiled.png'})")
    # Warmup Shapes' badge counts the regions that ran compiled code, as its status line does
    assert any(re.fullmatch(rf"{backend} · compiled (\d+)/\1", b) for b in page.node(WARMUP)["badges"]), \
        page.node(WARMUP)
    final = page.node(WARMUP)["progress"]
    assert final.startswith(f"{backend}: compiled, ") and " regions ran compiled code, 1 shape(s) in " in final, final
    assert "compiling" in shots, "never saw Warmup Shapes in the compiling state"

    # headless users: the same facts in /history
    entry = _history(server, status[1]["prompt_id"])
    assert f"status: {backend}: planned, " in _ui_text(entry, COMPILE), _ui_text(entry, COMPILE)
    warm = _ui_text(entry, WARMUP)
    assert f"warmed {SHAPE}" in warm and f"status: {backend}: compiled, " in warm, warm
    assert " regions ran compiled code, 1 shape(s)" in warm, warm
    assert len(page.errors) == errors_before, "browser errors while running:\n" + "\n".join(page.errors)

    # ---- triton is not in this release: a visible fallback, with the fix
    t0 = time.time()
    page.js("""() => {
        const w = window.comfyAPI.app.app.graph.getNodeById(10).widgets.find((w) => w.name === "backend");
        w.value = "triton"; w.callback?.("triton");
    }""")
    toast = page.page.locator(".p-toast-message", has_text="fell back")
    seen = {}

    def watch_toast():
        # the toast appears when Compile UNet runs and fades after 20 s: catch it while the prompt runs
        if "toast" not in seen and toast.count():
            seen["toast"] = toast.first.inner_text()
            page.shot("04_fallback_toast.png")

    status = _queue_and_wait(page, 1, on_poll=watch_toast)
    assert status[0] == "execution_success", f"prompt failed: {status}\nserver log:\n{server.log_tail(4000)}"
    watch_toast()
    page.js("() => window.comfyAPI.app.app.graph.setDirtyCanvas(true, true)")
    time.sleep(1.0)
    page.shot("05_fallback_done.png")
    print(f"[browser] triton -> fallback run: {time.time() - t0:.1f} s")
    assert "toast" in seen, "no 'fell back' toast appeared"
    assert "triton" in seen["toast"] and "Fix:" in seen["toast"], seen["toast"]
    events = page.js("() => window.__uc.events")
    ev = [e for n, e in events if n == "compile"][-1]
    assert (ev["requested"], ev["state"], ev["backend"]) == ("triton", "fallback", backend), ev
    assert ev["reason"] and ev["fix"], ev
    state = page.node(COMPILE)
    assert any(b.startswith(f"{backend} · fallback") for b in state["badges"]), state
    assert _badge_pixels(page, COMPILE, BADGE_COLORS["fallback"]) > 100, "no red fallback badge drawn"
    entry = _history(server, status[1]["prompt_id"])
    assert "Fix:" in _ui_text(entry, COMPILE), _ui_text(entry, COMPILE)
    assert len(page.errors) == errors_before, "browser errors while running:\n" + "\n".join(page.errors)
