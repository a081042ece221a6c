"""Tell the user what the pack did: in the browser, in /history and in the log.

The same facts go three ways: websocket events through ComfyUI's ``PromptServer``
(``EVENT_PREFIX`` + ``compile`` / ``warmup`` / ``fallback`` / ``recompile``, JSON; the web
extension in ``web/`` draws a badge and toasts a fallback from them), live text on the node,
and log lines plus a ``status:`` line in the node's report (kept in ``/history``). Without a
running ComfyUI server every send is a no-op. The events' fields: docs/internals.md.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time

from ..compiler.api import compile_facts, current_prompt, runtime_fallback, status_line

log = logging.getLogger(__name__)

EVENT_PREFIX = "unet_compiler."
#: seconds between live "compiling… 12 s" updates while one warmup shape runs
TICK_SECONDS = 1.0


# ---- transport ----------------------------------------------------------------
def server():
    """ComfyUI's running PromptServer, or None. Never imports anything: inside
    ComfyUI, main.py has imported ``server`` long before any node runs."""
    mod = sys.modules.get("server")
    cls = getattr(mod, "PromptServer", None)
    return getattr(cls, "instance", None)


def send(event: str, data: dict) -> None:
    """Send a custom event to the client that queued the prompt (all clients
    when it has none). No-op without a server. Run-time events (``fallback``,
    ``recompile``) are also kept for the running prompt's ``/history``."""
    srv = server()
    if srv is None:
        return
    try:
        srv.send_sync(EVENT_PREFIX + event, data, getattr(srv, "client_id", None))
    except Exception:  # feedback must never fail a prompt
        log.debug("UNet Compiler: event %s not sent", event, exc_info=True)
    if event in HISTORY_EVENTS:
        _keep_for_history(srv, EVENT_PREFIX + event, data)


def prompts_pending() -> bool:
    """Whether ComfyUI's queue has a prompt queued or running (False without a server): a CPU
    model's background compile waits while it has (the scheduler's activity: ``watch_the_queue``)."""
    queue = getattr(server(), "prompt_queue", None)
    remaining = getattr(queue, "get_tasks_remaining", None)
    return bool(remaining()) if remaining is not None else False


def watch_the_queue(activity) -> None:
    """Tell the background compile when ComfyUI's queue is busy (``activity``: the scheduler's)."""
    activity.watch(prompts_pending)


# ---- run-time events into the prompt's /history ------------------------------------
#: events that happen while KSampler runs, when none of the pack's nodes executes: their text would
#: otherwise reach only the browser and the log
HISTORY_EVENTS = ("fallback", "recompile")
#: at most this many kept per prompt (a long queue item cannot grow its history without bound)
HISTORY_MAX = 20
_pending: dict = {}   # prompt id -> [(event, data)]


def _keep_for_history(srv, event: str, data: dict) -> None:
    """Keep ``event`` for the prompt running now; ComfyUI's queue puts it into that prompt's
    ``/history`` entry (``status.messages``, beside its own ``execution_start`` ...) when the
    prompt ends. Never raises."""
    try:
        prompt = current_prompt()
        queue = getattr(srv, "prompt_queue", None)
        if not prompt or queue is None or not _hook_task_done(queue):
            return
        kept = _pending.setdefault(prompt, [])
        if len(kept) < HISTORY_MAX:
            kept.append((event, {**data, "timestamp": int(time.time() * 1000)}))
    except Exception:
        log.debug("UNet Compiler: event %s not kept for /history", event, exc_info=True)


def _hook_task_done(queue) -> bool:
    """Wrap this queue's ``task_done(item_id, history_result, status, ...)`` (ComfyUI's
    PromptQueue, which writes ``/history``) once, so the prompt's kept events join its status
    messages. False where the queue does not look like ComfyUI's (then nothing is kept)."""
    done = getattr(queue, "task_done", None)
    if getattr(done, "unet_compiler_history", False):
        return True
    if done is None or not hasattr(queue, "currently_running"):
        return False

    def task_done(item_id, history_result, status=None, *args, **kwargs):
        try:
            item = queue.currently_running.get(item_id)
            kept = _pending.pop(item[1], None) if item is not None else None
            if kept and status is not None and hasattr(status, "_replace"):
                status = status._replace(messages=list(status.messages or []) + kept)
        except Exception:
            log.debug("UNet Compiler: kept events not added to /history", exc_info=True)
        return done(item_id, history_result, status, *args, **kwargs)

    task_done.unet_compiler_history = True
    queue.task_done = task_done
    return True


def progress_text(text: str, node_id) -> None:
    """Live text under the node (ComfyUI's progress-text preview). No-op
    without a server or a node id."""
    srv = server()
    if srv is None or node_id is None:
        return
    try:
        srv.send_progress_text(text, str(node_id), getattr(srv, "client_id", None))
    except Exception:
        log.debug("UNet Compiler: progress text not sent", exc_info=True)


# ---- what happened at Compile UNet ------------------------------------------------
def compiled(accel, node_id) -> dict:
    """Announce the Compile UNet result and remember the node for run-time
    fallbacks. Returns the facts (their ``text`` is the status line)."""
    facts = compile_facts(accel.report)
    facts["text"] = status_line(facts)
    attach(accel, node_id)
    send("compile", {"node_id": _id(node_id), **facts})
    progress_text(facts["text"], node_id)
    # the Accelerator already warned for an explicitly requested backend it could not use
    level = logging.WARNING if facts["state"] == "fallback" and facts["requested"] == "auto" else logging.INFO
    log.log(level, "UNet Compiler: Compile UNet%s: %s", _where(node_id), facts["text"])
    return facts


# ---- run-time fallbacks ------------------------------------------------------------
#: the key the nodes' listeners subscribe under (``Accelerator.events``): one of each kind a model
_LISTENER = "nodes"


class _FallbackListener:
    """The accelerator's ``fallback`` and ``recompile`` listener: a region kind failed and now runs
    the model's own code; code compiled after warmup. Keeps the backend's name, not the accelerator: the
    accelerator holds this listener, and a cycle between them would keep the UNet alive after
    ComfyUI drops the model, until Python's cyclic collector runs."""

    def __init__(self, accel):
        self.backend = accel.backend.name
        self.node_ids: list[str] = []

    def __call__(self, kind: str, reason: str) -> None:
        backend = self.backend
        said = runtime_fallback(backend, kind, reason)
        text = str(said)
        send("fallback", {"node_ids": list(self.node_ids), "backend": backend, "kind": kind,
                          "state": "fallback", "reason": reason, "fix": said.fix, "text": text})
        for node_id in self.node_ids:
            progress_text(text, node_id)

    def recompiled(self, event: dict) -> None:
        """The ``recompile`` event: code compiled after warmup, during this prompt."""
        send("recompile", {"node_ids": list(self.node_ids), "backend": self.backend,
                           **{k: event.get(k) for k in ("prompt", "shape", "graphs", "seconds", "guards", "text")}})
        for node_id in self.node_ids:
            progress_text(f"{self.backend}: recompile: {event.get('text')}", node_id)


def attach(accel, node_id) -> None:
    """Route the accelerator's run-time fallbacks to ``node_id`` (and to every
    node later added with this function)."""
    listener = accel.events.listener("fallback", _LISTENER)
    if listener is None:
        listener = accel.events.subscribe("fallback", _FallbackListener(accel), key=_LISTENER)
        accel.events.subscribe("recompile", listener.recompiled, key=_LISTENER)
    if node_id is not None and _id(node_id) not in listener.node_ids:
        listener.node_ids.append(_id(node_id))


# ---- Warmup Shapes -------------------------------------------------------------------
class WarmupFeedback:
    """Progress of one Warmup Shapes run: events, live node text, log lines.

    ``wrap(run_one)`` labels every UNet call warmup makes (priming probes, the
    listed shapes, the eager reference) and, while a call runs, refreshes the
    node text every ``TICK_SECONDS`` so a 100 s first compile is visibly alive.
    """

    def __init__(self, accel, shapes, node_id):
        self.accel, self.shapes, self.node_id = accel, list(shapes), node_id
        self.total = len(self.shapes)
        self._next: str | None = None   # the text of the step warmup told it is about to run
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._label = None      # what is running now, for the ticker
        self._since = 0.0
        self._stop = threading.Event()
        self._thread = None
        #: what warmup itself could not do (``running``'s caller says), and the end's status dict
        self.problem: str | None = None
        self.done: dict | None = None

    # -- lifecycle
    @contextlib.contextmanager
    def running(self, call, background: bool = False):
        """Around warmup's runs of ``call`` (a sampling-style call with a ``dropped`` note): yields the
        labelled call (:meth:`wrap`) and, while the block runs, renders the accelerator's warmup
        events: each ``warmup_step`` names the call about to run (:meth:`step`), each
        ``warmup_shape`` ticks the node's ProgressBar and says the shape done, ``warmup_done`` is
        how it ended. On the way out, even when the block raised, the ticker stops and the listeners
        go; then the end event and status go out (``self.done``, :meth:`finished`), naming
        ``self.problem`` (set inside: what warmup itself could not do) or the patches warmup ran without."""
        import comfy.utils
        total = self.total + 1
        pbar = comfy.utils.ProgressBar(total, node_id=self.node_id)

        def on_shape(i, shape, secs):
            pbar.update_absolute(i + 1, total)
            self.shape_done(i, shape, secs)

        if background:
            watch_the_queue(self.accel.scheduler.activity)
        events = self.accel.events
        ended = []
        events.subscribe("warmup_step", self.step, key=_LISTENER)
        events.subscribe("warmup_shape", on_shape, key=_LISTENER)
        events.subscribe("warmup_done", ended.append, key=_LISTENER)
        self.start()
        try:
            yield self.wrap(call)
        finally:
            for kind in ("warmup_step", "warmup_shape", "warmup_done"):
                events.unsubscribe(kind, _LISTENER)
            self.close()
            for note in (call.dropped, call.random_conds):
                if note:
                    self.accel.note(note, once=True)
        pbar.update_absolute(total, total)
        self.done = self.finished(ended[0] if ended else None, problem=self.problem or call.dropped)

    def start(self) -> None:
        attach(self.accel, self.node_id)
        labels = [s.label for s in self.shapes]
        verb = "compiling" if self.accel.backend.name != "eager" else "running"
        text = f"{self.accel.backend.name}: {verb} {self.total} shape(s): {', '.join(labels)}"
        self._send("start", text, state="compiling", shapes=labels)
        log.info("UNet Compiler: Warmup Shapes%s: %s", _where(self.node_id), text)
        if server() is not None and self.node_id is not None:
            self._thread = threading.Thread(target=self._tick, name="unet-compiler-warmup-ticker", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * TICK_SECONDS)

    def step(self, step) -> None:
        """The ``warmup_step`` listener: the call warmup is about to make (a ``Step``), as the node's
        text names it while it runs."""
        self._next = step.text + "…"

    def wrap(self, run_one):
        """``run_one``, each call named in the node's text while it runs (by the step warmup told
        before it, :meth:`step`)."""
        def labelled(shape):
            text, self._next = self._next or f"{shape.label}: running…", None
            self._running(text)
            try:
                return run_one(shape)
            finally:
                self._running(None)
        return labelled

    def shape_done(self, i: int, shape, secs: float) -> None:
        text = f"shape {i + 1}/{self.total}, {shape.label}, {secs:.1f} s"
        self._send("shape", text, state="compiling", index=i + 1, shape=shape.label, seconds=round(secs, 3),
                   elapsed=round(time.perf_counter() - self._t0, 3))
        log.info("UNet Compiler: Warmup Shapes%s: %s", _where(self.node_id), text)

    def finished(self, outcome, problem: str | None = None) -> dict:
        """The end event and status of the warmup that ended as ``outcome`` (the compiler's
        ``warmup_done`` event: an ``Outcome``, or None where warmup stopped before it told one);
        ``problem``: what warmup itself could not do (the model still runs: a patch left out of
        warmup, or a model warmup could not call)."""
        backend = self.accel.backend.name
        if outcome is None:
            state, reason, fix = "fallback", problem or "warmup stopped before its first call", ""
            text = f"{backend}: warmup stopped before its first call"
            data = {"seconds": round(time.perf_counter() - self._t0, 3), "graphs": 0, "loaded": 0,
                    "max_abs_diff": None, "tolerance": None}
        else:
            state, reason, fix, text = outcome.state, outcome.reason, outcome.fix, outcome.text
            data = {"seconds": round(outcome.seconds, 3), "graphs": outcome.graphs, "loaded": outcome.loaded,
                    "max_abs_diff": outcome.max_abs_diff, "tolerance": outcome.tolerance,
                    **({"ran": outcome.ran, "regions": outcome.regions} if state != "compiling" else {})}
            if state == "compiling":
                self.accel.events.subscribe("background_done", _background_done(
                    backend=backend, node_id=self.node_id, total=self.total, t0=self._t0), key=_LISTENER)
        if problem:
            text += f"; {problem}"
        self._send("end", text, state=state, reason=reason, fix=fix, **data)
        level = logging.WARNING if state == "fallback" else logging.INFO
        log.log(level, "UNet Compiler: Warmup Shapes%s: %s", _where(self.node_id), text)
        return {"state": state, "text": text, "reason": reason, "fix": fix}

    def skipped(self, why=None, note: str | None = None) -> dict:
        """The end event and status of a warmup with nothing to run: the model has nothing compiled,
        or ``why`` (a Reason) every region would run the model's own code, or ``note`` says why no
        entry can be called."""
        facts = compile_facts(self.accel.report)
        if why is not None:
            facts = dict(facts, state="eager", reason=f"every region runs the model's own code: {why.why}",
                         fix=why.fix)
        text = f"{note or 'eager: ' + facts['reason']}; nothing to warm up ({self.total} shape(s) skipped)"
        self._send("end", text, state=facts["state"], seconds=0.0, graphs=0, max_abs_diff=None,
                   reason=facts["reason"], fix=facts["fix"])
        log.info("UNet Compiler: Warmup Shapes%s: %s", _where(self.node_id), text)
        return {"state": facts["state"], "text": text, "reason": facts["reason"], "fix": facts["fix"]}

    # -- internals
    def _send(self, phase, text, **data):
        with self._lock:
            send("warmup", {"node_id": _id(self.node_id), "phase": phase, "backend": self.accel.backend.name,
                            "total": self.total, "text": text, **data})
            progress_text(text, self.node_id)

    def _running(self, label) -> None:
        with self._lock:
            self._label, self._since = label, time.perf_counter()
            if label is not None:
                progress_text(label, self.node_id)

    def _tick(self) -> None:
        while not self._stop.wait(TICK_SECONDS):
            with self._lock:
                if self._label is not None:
                    progress_text(f"{self._label} {time.perf_counter() - self._since:.0f} s", self.node_id)


def _background_done(backend: str, node_id, total: int, t0: float):
    """What tells the badge and node text that a warmup's background compile is done (its end event
    said ``compiling``). Called from the compile thread; refers to no accelerator (no cycle)."""
    def told(line: str, state: str) -> None:
        text = f"{backend}: {state}; {line}"
        send("warmup", {"node_id": _id(node_id), "phase": "end", "backend": backend, "total": total, "text": text,
                        "state": state, "seconds": round(time.perf_counter() - t0, 3), "max_abs_diff": None,
                        "reason": "", "fix": ""})
        progress_text(text, node_id)
        log.info("UNet Compiler: Warmup Shapes%s: %s", _where(node_id), text)
    return told


def _id(node_id):
    return None if node_id is None else str(node_id)


def _where(node_id) -> str:
    return "" if node_id is None else f" (node {node_id})"
