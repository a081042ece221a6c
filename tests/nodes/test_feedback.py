"""nodes/feedback.py: the facts the UI, /history and the log get, and the
no-op without a ComfyUI server. A fake ``server`` module stands in for
ComfyUI's PromptServer and records what would go over the websocket."""
from __future__ import annotations

import logging
import sys
import time
import types
from collections import Counter
from types import SimpleNamespace

import pytest

from unet_compiler.compiler.backends import Backend
from unet_compiler.compiler.config import DISABLE_ENV, CompileConfig
from unet_compiler.compiler.events import Events
from unet_compiler.compiler.lifecycle.recompiles import Recompiles
from unet_compiler.compiler.report import Report
from unet_compiler.compiler.shapes import parse_shapes
from unet_compiler.compiler.warmup import Counts, Step, _probes, outcome
from unet_compiler.nodes import feedback


class FakePromptServer:
    def __init__(self):
        self.client_id = "client-1"
        self.events: list[tuple[str, dict, str | None]] = []
        self.texts: list[tuple[str, str]] = []

    def send_sync(self, event, data, sid=None):
        self.events.append((event, data, sid))

    def send_progress_text(self, text, node_id, sid=None):
        self.texts.append((node_id, text))

    def named(self, name):
        return [d for e, d, _ in self.events if e == feedback.EVENT_PREFIX + name]


@pytest.fixture
def server(monkeypatch):
    srv = FakePromptServer()
    mod = types.ModuleType("server")
    mod.PromptServer = type("PromptServer", (), {"instance": srv})
    monkeypatch.setitem(sys.modules, "server", mod)
    return srv


def fake_accel(requested="auto", backend="inductor", why=(), regions=None, failed=None, dynamic=True):
    rep = Report(backend_requested=requested, backend=backend, why=list(why), family="comfy",
                 regions={"resblock": 22, "attention": 32} if regions is None else regions)
    be = Backend()
    be.name = backend
    return SimpleNamespace(config=CompileConfig(backend=requested, dynamic_shapes=dynamic), report=rep,
                           backend=be, stats=Counter(), failed=dict(failed or {}), root=None, graphs=None,
                           warmed=False, bypassed=False, events=Events(), background=None,
                           recompiles=Recompiles(), ran_compiled=lambda: (54, 54), cast_eager={}, device_type="cpu",
                           plan=SimpleNamespace(arch="unet"), inserted=SimpleNamespace(video_length=None))


def test_no_server_is_a_noop(monkeypatch, caplog):
    monkeypatch.delitem(sys.modules, "server", raising=False)
    feedback.send("compile", {"x": 1})
    feedback.progress_text("hello", "3")
    with caplog.at_level(logging.INFO, logger=feedback.__name__):
        facts = feedback.compiled(fake_accel(), "3")
    assert facts["state"] == "planned"
    assert "inductor: planned, 54 regions; compiled code runs after Warmup Shapes" in caplog.text  # the log still has it


def test_unrelated_server_module_is_ignored(monkeypatch):
    monkeypatch.setitem(sys.modules, "server", types.ModuleType("server"))  # some other package's "server"
    feedback.send("compile", {})
    feedback.progress_text("hello", "3")


def test_a_cpu_background_compile_is_told_when_comfyuis_queue_is_busy(server, monkeypatch):
    """``prompts_pending``: ComfyUI's queue has a prompt queued or running; ``watch_the_queue``
    makes it one of the background compile's activity signals, once."""
    from unet_compiler.compiler.lifecycle.pacing import Activity
    assert feedback.prompts_pending() is False                     # a server without a queue
    remaining = [2]
    server.prompt_queue = SimpleNamespace(get_tasks_remaining=lambda: remaining[0])
    assert feedback.prompts_pending() is True
    remaining[0] = 0
    assert feedback.prompts_pending() is False
    activity = Activity()
    feedback.watch_the_queue(activity)
    feedback.watch_the_queue(activity)
    assert activity.signals == [feedback.prompts_pending]
    remaining[0] = 1
    assert not activity.idle()


def test_compiled_event_text_and_target(server):
    facts = feedback.compiled(fake_accel(why=["ipex: not installed", "inductor: chosen (regional torch.compile)"]), 11)
    (data,) = server.named("compile")
    assert server.events[0][2] == "client-1"  # to the client that queued the prompt
    assert data["node_id"] == "11" and data["backend"] == "inductor" and data["state"] == "planned"
    assert data["reason"] == "" and data["fix"] == "" and data["regions"] == {"resblock": 22, "attention": 32}
    assert server.texts == [("11", facts["text"])]


@pytest.mark.parametrize("requested, backend, why, state, reason_has, fix_has", [
    ("triton", "inductor", ["triton: not available yet: the fused Triton kernels are not in this release (use inductor)",
                            "inductor: chosen (regional torch.compile)"],
     "fallback", "not available yet", "choose inductor or auto in Select Backend"),
    ("triton", "inductor", ["triton: no CUDA GPU: the triton backend needs one", "inductor: chosen"],
     "fallback", "no CUDA GPU", "choose inductor or auto"),
    ("auto", "eager", ["ipex: not installed", "inductor: no C++ compiler (g++) found for inductor's CPU code; install "
                       "gcc (Linux) or MSVC Build Tools (Windows)", "eager: chosen (no rewrites)"],
     "fallback", "no C++ compiler", "install gcc (Linux) or MSVC Build Tools (Windows), then restart ComfyUI"),
    ("auto", "eager", ["torch 2.1.0 is older than 2.3, which torch.compile regional compilation needs; running eager. "
                       "Fix: upgrade torch (pip install -U torch)."],
     "fallback", "older than 2.3", "upgrade torch (pip install -U torch)"),
    ("eager", "eager", [], "eager", "chosen in Select Backend", "choose auto"),
])
def test_fallback_reason_and_fix(server, requested, backend, why, state, reason_has, fix_has):
    facts = feedback.compiled(fake_accel(requested, backend, why, regions={} if backend == "eager" else None), "4")
    assert facts["state"] == state, facts
    assert reason_has in facts["reason"] and fix_has in facts["fix"], facts
    assert "Fix:" not in facts["reason"]
    if state == "fallback":
        assert f"{backend}: fallback" in facts["text"] and f"Fix: {facts['fix']}" in facts["text"]


def test_disabled_by_env(server, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")
    facts = feedback.compiled(fake_accel("inductor", "eager", regions={}), "4")
    assert facts["state"] == "eager" and DISABLE_ENV in facts["reason"] and DISABLE_ENV in facts["fix"]


def test_warmup_progress_and_ticker(server, monkeypatch):
    monkeypatch.setattr(feedback, "TICK_SECONDS", 0.02)
    accel = fake_accel()
    shapes = parse_shapes("1x64x64, 2x64x64")
    fb = feedback.WarmupFeedback(accel, shapes, "12")
    since = Counts.now(accel)     # (where warmup_runs starts counting)
    fb.start()
    calls = []

    def run_one(shape):
        calls.append(shape)
        time.sleep(0.15)
        accel.stats["graphs_compiled"] += 1

    run = fb.wrap(run_one)
    probes = _probes(accel, shapes)   # (what warmup_runs tells, step by step, before each call)
    try:
        for k, probe in enumerate(probes):
            fb.step(Step("probe", probe, k, len(probes)))
            run(probe)
        for i, shape in enumerate(shapes):
            fb.step(Step("shape", shape, i, len(shapes)))
            run(shape)
            fb.shape_done(i, shape, 0.25)
    finally:
        fb.close()
    done = fb.finished(outcome(accel, len(shapes), since))   # (the outcome warmup_runs tells at its end)

    phases = [(d["phase"], d["state"]) for d in server.named("warmup")]
    assert phases == [("start", "compiling"), ("shape", "compiling"), ("shape", "compiling"), ("end", "compiled")]
    shape2 = server.named("warmup")[2]
    assert (shape2["index"], shape2["total"], shape2["shape"], shape2["seconds"]) == (2, 2, "2x64x64", 0.25)
    texts = [t for n, t in server.texts if n == "12"]
    assert "priming 1/2, 2x64x64: compiling…" in texts and "shape 2/2, 2x64x64: running…" in texts
    assert "shape 1/2, 1x64x64, 0.2 s" in texts or "shape 1/2, 1x64x64, 0.3 s" in texts
    assert any(t.startswith("priming 1/2, 2x64x64: compiling… ") and t.endswith(" s") for t in texts), texts
    assert done["state"] == "compiled" and texts[-1] == done["text"]
    assert done["text"].startswith("inductor: compiled, 54 of 54 regions ran compiled code, 2 shape(s) in ")
    assert "4 graph(s) compiled" in done["text"]
    assert not fb._thread.is_alive()


def test_graph_capture_run_is_labelled(server):
    accel = fake_accel()
    accel.graphs = object()  # cuda graphs on: warmup runs each shape a second time to capture
    shapes = parse_shapes("2x64x64")
    fb = feedback.WarmupFeedback(accel, shapes, "12")
    run = fb.wrap(lambda shape: None)
    for k, probe in enumerate(_probes(accel, shapes)):
        fb.step(Step("probe", probe, k, 2))
        run(probe)
    for kind in ("shape", "capture"):
        fb.step(Step(kind, shapes[0], 0, 1))
        run(shapes[0])
    texts = [t for n, t in server.texts if n == "12"]
    assert texts[-2:] == ["shape 1/1, 2x64x64: running…", "shape 1/1, 2x64x64: capturing CUDA graphs…"], texts


def test_each_call_is_named_by_the_step_warmup_tells(server):
    """The node's text names what warmup said it runs, never a guess by counting calls: a one-shape
    warmup (no probes) compiles its shape, the reference, the compare's checks and the timing say so."""
    accel = fake_accel()
    shape = parse_shapes("2x64x64")[0]
    fb = feedback.WarmupFeedback(accel, [shape], "12")
    run = fb.wrap(lambda s: None)
    for step in (Step("reference", shape), Step("shape", shape, 0, 1, compiles=True), Step("check", shape),
                 Step("measure", shape)):
        fb.step(step)
        run(shape)
    run(shape)   # a call warmup told nothing of
    texts = [t for n, t in server.texts if n == "12"]
    assert texts == ["eager reference, 2x64x64: running…", "shape 1/1, 2x64x64: compiling…",
                     "2x64x64: checking which region kinds make the difference…",
                     "2x64x64: timing each region kind against the model's own code…", "2x64x64: running…"], texts


def test_runtime_fallback_listener(server):
    accel = fake_accel()
    feedback.compiled(accel, "11")
    feedback.attach(accel, "12")
    feedback.attach(accel, "12")
    accel.events.emit("fallback", "attention", "RuntimeError: boom")
    (data,) = server.named("fallback")
    assert data["node_ids"] == ["11", "12"] and data["kind"] == "attention" and data["state"] == "fallback"
    assert data["reason"] == "RuntimeError: boom" and data["fix"]
    assert ("11", data["text"]) in server.texts and ("12", data["text"]) in server.texts


def test_runtime_events_reach_the_prompts_history(server, monkeypatch):
    """A fallback or recompile during sampling (no pack node runs then) joins that prompt's
    /history status messages, through the queue's task_done, as ComfyUI's own messages do."""
    from collections import namedtuple

    status_t = namedtuple("ExecutionStatus", ["status_str", "completed", "messages"])
    history = {}

    class Queue:   # the part of ComfyUI's PromptQueue the hook relies on
        def __init__(self):
            self.currently_running = {7: (0, "prompt-A", {}, {}, []), 8: (1, "prompt-B", {}, {}, [])}

        def task_done(self, item_id, history_result, status, process_item=None):
            prompt = self.currently_running.pop(item_id)
            history[prompt[1]] = {"status": status._asdict(), **history_result}

    server.prompt_queue = Queue()
    accel = fake_accel()
    feedback.compiled(accel, "11")
    monkeypatch.setattr(feedback, "current_prompt", lambda: "prompt-A")
    accel.events.emit("fallback", "attention", "RuntimeError: boom")
    for i in range(feedback.HISTORY_MAX + 5):
        accel.events.emit("recompile", {"prompt": "prompt-A", "shape": "4x64x64", "graphs": 2, "seconds": 1.0,
                                         "guards": [], "text": f"recompile {i}"})
    started = ("execution_start", {"prompt_id": "prompt-A", "timestamp": 1})
    server.prompt_queue.task_done(7, {"outputs": {}}, status=status_t("success", True, [started]))
    server.prompt_queue.task_done(8, {"outputs": {}}, status_t("success", True, []))   # another prompt: nothing added
    messages = history["prompt-A"]["status"]["messages"]
    assert messages[0] == started and len(messages) == 1 + feedback.HISTORY_MAX
    names = [name for name, _ in messages[1:]]
    assert names[0] == "unet_compiler.fallback" and set(names[1:]) == {"unet_compiler.recompile"}
    assert "RuntimeError: boom" in messages[1][1]["text"] and messages[2][1]["text"] == "recompile 0"
    assert history["prompt-B"]["status"]["messages"] == [] and not feedback._pending
    monkeypatch.setattr(feedback, "current_prompt", lambda: None)   # outside a prompt: only sent
    accel.events.emit("fallback", "resblock", "RuntimeError: again")
    assert not feedback._pending and server.named("fallback")[-1]["kind"] == "resblock"


# ---- through the real nodes' glue and ComfyUI's own UNet (skips without ComfyUI) ----
@pytest.mark.comfy
def test_patcher_sends_compile_warmup_and_runtime_fallback(make_comfy_model, server, monkeypatch):
    from unet_compiler.compiler.backends import lookup_backend
    from unet_compiler.nodes import patcher

    def boom(module, *args):
        raise RuntimeError("simulated kernel failure")

    class AllFail(dict):
        def get(self, key, default=None):
            return boom

    monkeypatch.setattr(lookup_backend("inductor"), "impls", lambda self, config, scheduler: AllFail())
    mp = make_comfy_model("sd15")
    cm, text = patcher.compile_model(mp, CompileConfig(backend="inductor"), node_id="5")
    assert "status: inductor: planned, " in text
    (compiled,) = server.named("compile")
    assert (compiled["node_id"], compiled["state"], compiled["backend"]) == ("5", "planned", "inductor")

    report = patcher.warmup_model(cm, "1x64x64", 77, node_id="6")
    kinds = {d["kind"] for d in server.named("fallback")}
    assert {"resblock", "attention"} <= kinds, server.events
    assert all(d["node_ids"] == ["5", "6"] for d in server.named("fallback"))
    end = server.named("warmup")[-1]
    assert end["phase"] == "end" and end["state"] == "fallback" and "simulated kernel failure" in end["reason"]
    assert "status: inductor: fallback" in report and "simulated kernel failure" in report  # /history
    assert any(n == "5" and "fallback" in t for n, t in server.texts)


def test_probe_reasons_give_their_fix(server):
    from unet_compiler.compiler.compat import ipex as ipex_compat
    from unet_compiler.compiler.reasons import Reason
    bad = ipex_compat.mismatch("2.8.0", "2.13.0")
    assert isinstance(bad, Reason) and str(bad).endswith(f". Fix: {bad.fix}") and "Fix" not in bad.why
    facts = feedback.compiled(fake_accel("ipex", "inductor", [bad.about("ipex"), Reason("chosen", what="inductor")]), "4")
    assert facts["state"] == "fallback" and facts["fix"] == bad.fix and facts["reason"] == f"ipex: {bad.why}"
