"""A CPU double of ComfyUI's own compiler: ``comfy/model_prefetch.py`` (@03fb330a) as a
``comfy.model_prefetch`` module over ComfyUI 0.8.0, which has none, recording through a double of
comfy-aimdo's allocation recorder (its Python side, ``malloc_graph.py`` 0.6.0, and the native
``malloc-graph.c`` of the same lineage: ``malloc_graph_create(devctx, stream, assert_breaks)``,
``malloc_graph_pause(handle, paused, sync)``, rogue hand-off). Rewritten from them, not copied.

The recorder, as the native one works:
- Events: an allocation (its bytes), a named scope's call, a scope's end. They form a tree: each
  event keeps as children the events seen after it, one branch per pattern seen.
- The first pass records: each event is appended under the cursor (a call does not move its
  parent's cursor, so the next push of that name finds it). A later push of a known name, and every
  forward after the first (``push()`` with no name: from the root), replays: each allocation must
  match a child of the cursor with its bytes, each push a call of its name, each pop an end.
- A replay that finds no match is a graph break. Under ``--assert-graph-breaks`` the graph fails:
  every later call returns false, which the Python side raises as "aimdo memory compile error" (the
  native fails the allocation itself; here the scope's ``pop`` raises, naming what broke). Without
  it, recording resumes there on a new branch and that scope's ``pop`` returns 2: ComfyUI counts a
  break (``MALLOC_GRAPH_BREAKS``).
- What it sees: on the thread that records, while a scope is active and not paused, every storage
  an aten op returns that none of its inputs owns (a dispatch mode pushed on resume, popped on
  pause), but the Dynamic VRAM double's offload-stream work (a slot's fault and copy: the native
  recorder keeps to its own stream). Paused code (``pause_malloc_graph``) allocates from the normal allocator, unrecorded.
- Dynamo steps aside while a dispatch mode is on: a torch.compile'd function called in an active,
  unpaused scope runs eager here (the pack's compiled code runs paused, so it is unaffected).

``prefetch_queue_pop`` as the newest one: the scope's ``iterate``, the queue's consume, and with
``enable_graph`` and a ``core`` a block captured as a CUDA graph once it ran warmed and its slots
are all resident (every ``_v`` leaf's slot faulted with a signature), replayed while that holds,
``core`` run on the capture stream otherwise; with ``block_graphs`` (ComfyUI's ``is_device_cuda``),
the CUDA graphs being ``tests/_fake_cuda.py``'s, which the test installs.

Left out: frees (the native matches them too; a CPU tensor's free has no hook here), rogues
(allocations that outlive their scope: counted, handed to the normal allocator, not breaks),
addresses and the small and large pools, the prefetch queue's early casts (a block's slots cast
one block ahead; the Dynamic VRAM double casts each op as it runs).
"""
from __future__ import annotations

import contextlib
import sys
import threading
import types

import torch


class CompileError(RuntimeError):
    """comfy-aimdo's ``MallocGraph._call`` on a failed native call."""


class _Event:
    __slots__ = ("kind", "value", "children", "scope")

    def __init__(self, kind: str, value=None):
        self.kind, self.value, self.children, self.scope = kind, value, [], None

    def find(self, kind: str, value=None):
        return next((e for e in self.children if e.kind == kind and e.value == value), None)


class _State:
    __slots__ = ("cursor", "recording", "broken")

    def __init__(self, cursor: _Event, recording: bool):
        self.cursor, self.recording, self.broken = cursor, recording, False


class MallocGraph:
    """comfy-aimdo's ``MallocGraph`` (``record(stream, assert_graph_breaks)``) with the native
    recorder's rules (module docstring). ``breaks``: what broke, in words; ``events``: allocations
    recorded or replayed (a test's evidence that the recorder saw something)."""

    def __init__(self, stream, assert_graph_breaks: bool):
        self._stream = stream
        self.assert_graph_breaks = assert_graph_breaks
        self.root = _Event("root")
        self.stack: list[_State] = [_State(self.root, True)]
        self.complete = False
        self.failed: str | None = None
        self.paused = False
        self.breaks: list[str] = []
        self.allocations = self.replayed = 0
        #: graph replays under way (their ops allocate nothing on a GPU)
        self.replaying = 0
        #: blocks whose CUDA graphs were captured under this recording (``_comfy_cuda_graph_modules``)
        self.cuda_graph_modules: list = []
        self._scopes: list = []
        self._active = False
        self._thread = threading.get_ident()
        from ._dynamic_vram import Allocations
        self._mode = Allocations(lambda storage: self.allocated(storage.nbytes()))
        self._mode_on = False

    # ---- what ComfyUI sets and reads -----------------------------------------
    @property
    def _comfy_active(self) -> bool:
        return self._active

    @_comfy_active.setter
    def _comfy_active(self, value: bool) -> None:
        self._active = value
        self._sync_mode()

    rogue_count = 0

    def _sync_mode(self) -> None:
        want = self._active and not self.paused and not self.complete and self.failed is None \
            and threading.get_ident() == self._thread
        if want and not self._mode_on:
            torch.utils._python_dispatch._push_mode(self._mode)
            self._mode_on = True
        elif not want and self._mode_on:
            top = torch.utils._python_dispatch._pop_mode()
            assert top is self._mode, f"the recorder's mode is not on top of the stack ({top!r})"
            self._mode_on = False

    # ---- the native rules -----------------------------------------------------
    def _break(self, why: str) -> bool:
        """A replay found no match: False (the graph failed) under ``--assert-graph-breaks``, else
        True, recording from here on a new branch."""
        self.breaks.append(why)
        if self.assert_graph_breaks:
            self.failed = why      # (the mode goes at the next call: it is off the stack while it runs)
            return False
        state = self.stack[-1]
        state.recording = state.broken = True
        return True

    def allocated(self, nbytes: int) -> None:
        from ._dynamic_vram import STREAM
        if self.failed is not None or self.paused or self.replaying or not self.stack \
                or getattr(STREAM, "offload", False):
            return
        state = self.stack[-1]
        if not state.recording:
            match = state.cursor.find("alloc", nbytes)
            if match is not None:
                state.cursor = match
                self.replayed += 1
                return
            if not self._break(f"an allocation the replay does not expect ({nbytes} bytes)"):
                return
        event = _Event("alloc", nbytes)
        state.cursor.children.append(event)
        state.cursor = event
        self.allocations += 1

    def _fail(self):
        self._sync_mode()
        raise CompileError(f"aimdo memory compile error ({self.failed})")

    def push(self, name=None):
        if self.failed is not None:
            self._fail()
        if name is None:       # a later forward: replay from the root
            if not self.complete:
                self._fail()
            self.stack, self.complete = [_State(self.root, False)], False
            self._sync_mode()
            return
        state = self.stack[-1]
        call = state.cursor.find("call", name)
        recording = call is None
        if recording:
            if not state.recording and not self._break(f"a scope the replay does not expect ({name})"):
                self._fail()
            call = _Event("call", name)
            call.scope = _Event("scope")
            state.cursor.children.append(call)
        self.stack.append(_State(call.scope, recording))
        self._scopes.append(name)

    def pop(self) -> bool:
        """True where this scope broke (native 2)."""
        if self.failed is not None:
            self._fail()
        state = self.stack[-1]
        if not state.recording:
            end = state.cursor.find("end")
            if end is not None:
                state.cursor = end
            elif not self._break("the scope ends before the replay's end"):
                self._fail()
        if state.recording:
            state.cursor.children.append(_Event("end"))
        self.stack.pop()
        if self._scopes:
            self._scopes.pop()
        if not self.stack:
            self.complete = True
            self._sync_mode()
        return state.broken

    def iterate(self, name=None) -> bool:
        broken = False
        if name is None:
            if self._scopes:
                broken = self.pop()
            return broken
        if self._scopes and self._scopes[-1] == name:
            broken = self.pop()
        self.push(name)
        return broken

    def abort(self):
        self.stack, self._scopes = [], []
        self.complete = True
        self._sync_mode()

    def pause(self, sync=False):
        if self.failed is not None:
            self._fail()
        self.paused = True
        self._sync_mode()

    def resume(self, sync=False):
        if self.failed is not None:
            self._fail()
        self.paused = False
        self._sync_mode()

    @contextlib.contextmanager
    def use_stream(self, stream):
        previous, self._stream = self._stream, stream
        try:
            yield
        finally:
            self._stream = previous


class ComfyCompiler:
    """``comfy.model_prefetch`` as the newest ComfyUI has it, over the recorder double. ``scope()``
    is what a model that opts in wraps its forward in (``malloc_graph_scope``); its blocks call
    ``prefetch_queue_pop`` with a ``malloc_scope``. ``breaks()``: every recording's breaks."""

    def __init__(self, assert_graph_breaks: bool = True, block_graphs: bool = False):
        self.assert_graph_breaks = assert_graph_breaks
        #: ComfyUI's ``is_device_cuda``: block CUDA graphs (a test with tests/_fake_cuda.py installed)
        self.block_graphs = block_graphs
        self.module = mod = types.ModuleType("comfy.model_prefetch")
        mod.MALLOC_GRAPHS = {}
        mod.MALLOC_GRAPH_BREAKS = 0
        mod.PREFETCH_QUEUES = []
        mod.GRAPH_CAPTURE_STREAMS = {}
        mod.malloc_graph_enabled = lambda device: True
        mod.pause_malloc_graph = self._pause
        mod.malloc_graph_scope = self.scope
        mod.malloc_graph_begin = self.begin
        mod.malloc_graph_end = self.end
        mod.cleanup_malloc_graph = self.cleanup_malloc_graph
        mod.cleanup_prefetch_queues = self.cleanup
        mod.make_prefetch_queue = self.make_prefetch_queue
        mod.prefetch_queue_pop = self.prefetch_queue_pop
        self.recordings: list[MallocGraph] = []
        self.warmed: set = set()
        #: blocks captured and replayed as CUDA graphs (ComfyUI's own, by ``prefetch_queue_pop``)
        self.captures = self.block_replays = 0

    @staticmethod
    def opt_in(module, method: str = "forward") -> None:
        """``module``'s ``method`` run inside ``malloc_graph_scope``, as a model that opts into ComfyUI's
        compiler writes its forward (its class swapped for a subclass of the same names)."""
        import comfy
        cls = type(module)
        own = getattr(cls, method)

        def scoped(self, *args, **kwargs):
            with comfy.model_prefetch.malloc_graph_scope(None):
                return own(self, *args, **kwargs)
        from ._written import as_written
        module.__class__ = as_written(type(cls.__name__, (cls,), {method: scoped, "__module__": cls.__module__,
                                                                  "__qualname__": cls.__qualname__}))

    def _current(self):
        return self.module.MALLOC_GRAPHS.get(threading.get_ident())

    def _counted(self, broken: bool) -> None:
        if broken:
            self.module.MALLOC_GRAPH_BREAKS += 1

    @contextlib.contextmanager
    def _pause(self, sync=False):
        graph = self._current()
        active = graph is not None and graph._comfy_active
        if active:
            graph.pause(sync)
        try:
            yield
        finally:
            if active:
                graph.resume(sync)

    def begin(self, device=None):
        graph = self._current()
        if graph is None:
            graph = self.module.MALLOC_GRAPHS[threading.get_ident()] = MallocGraph(None, self.assert_graph_breaks)
            self.recordings.append(graph)
        else:
            graph.push()
        graph._comfy_active = True

    def end(self):
        graph = self._current()
        if graph is not None and graph._comfy_active:
            try:
                broken = graph.pop()
            except Exception:
                self.module.MALLOC_GRAPHS.pop(threading.get_ident(), None)
                graph._comfy_active = False
                raise
            graph._comfy_active = False
            self._counted(broken)

    def cleanup_malloc_graph(self):
        """This thread's recording goes, and the block graphs captured under it."""
        graph = self.module.MALLOC_GRAPHS.pop(threading.get_ident(), None)
        if graph is None:
            return
        if graph._comfy_active:
            graph._comfy_active = False
            graph.abort()
        for module in graph.cuda_graph_modules:
            module.__dict__.pop("_comfy_graph", None)

    @contextlib.contextmanager
    def scope(self, device=None):
        self.begin(device)
        try:
            yield self._current()
        except BaseException:
            self.cleanup_malloc_graph()
            raise
        self.end()

    def cleanup(self):
        """``cleanup_prefetch_queues`` (between nodes): the recording, its block graphs and the warmed
        blocks go."""
        self.cleanup_malloc_graph()
        self.module.PREFETCH_QUEUES = []
        self.warmed.clear()

    def make_prefetch_queue(self, queue, device, transformer_options):
        if not transformer_options.get("prefetch_dynamic_vbars", False):
            return None
        queue = [None] + list(queue) + [None]
        self.module.PREFETCH_QUEUES.append(queue)
        return queue

    @staticmethod
    def _slots(root) -> list:
        return [s for s in root.modules() if "_v" in s.__dict__]

    def prefetch_queue_pop(self, queue, device, module, dtype=None, core=None, enable_graph=False,
                           generator=None, malloc_scope=None):
        graph = self._current()
        if graph is not None and not graph._comfy_active:
            graph = None
        enable_graph = enable_graph and graph is not None and self.block_graphs and module is not None
        if queue is None:
            if graph is not None and malloc_scope is not None:
                self._counted(graph.iterate(malloc_scope if module is not None else None))
            if core is not None:
                core()
            return
        from comfy_aimdo import model_vbar
        captured = module.__dict__.get("_comfy_graph") if enable_graph else None
        signature = self._resident(module) if captured is not None else None
        hit = captured is not None and signature is not None and signature == captured["signature"]
        if graph is not None and malloc_scope is not None:
            self._counted(graph.iterate(malloc_scope if module is not None and not hit else None))
        consumed = queue.pop(0)
        if consumed is not None:
            for s in consumed:
                model_vbar.vbar_unpin(s._v)
        if hit:
            queue[0] = []
            captured["graph"].replay()
            self.block_replays += 1
            return
        pinned = []
        if queue[0] is not None:       # the next block's slots, faulted and pinned (pin_modules)
            for s in self._slots(queue[0]):
                if model_vbar.vbar_fault(s._v) is not None:
                    pinned.append(s)
            queue[0] = pinned
        if core is None:
            return
        if enable_graph and module in self.warmed:
            signature = self._resident(module)
            if signature is not None:
                module.__dict__.pop("_comfy_graph", None)
                cuda_graph = torch.cuda.CUDAGraph()
                stream = self.module.GRAPH_CAPTURE_STREAMS.setdefault(device, torch.cuda.Stream())
                graph.pause(sync=True)
                # (torch.cuda.graph's capture on the capture stream, less its cache emptying)
                with graph.use_stream(stream), torch.cuda.stream(stream):
                    cuda_graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        graph.resume()
                        core()
                        graph.pause()
                    finally:
                        cuda_graph.capture_end()
                graph.resume(sync=True)
                cuda_graph.replay()
                module.__dict__["_comfy_graph"] = {"graph": cuda_graph, "signature": signature}
                graph.cuda_graph_modules.append(module)
                self.captures += 1
                return
        core()
        if enable_graph:
            self.warmed.add(module)

    def _resident(self, module):
        """The block's slots' signatures while all are resident (``vbar_fault`` of its ``_v_block``),
        else None. A resident slot's fault pins it till the next ``vbar_unpin``."""
        from comfy_aimdo import model_vbar
        signature = []
        for s in self._slots(module):
            got = model_vbar.vbar_fault(s._v)
            if got is None:
                return None
            signature.append((id(s), got))
            model_vbar.vbar_unpin(s._v)
        return tuple(signature)

    @contextlib.contextmanager
    def installed(self):
        import comfy

        from . import _fake_cuda
        sys.modules["comfy.model_prefetch"] = comfy.model_prefetch = self.module
        _fake_cuda.REPLAY_HOOKS.append(self._replaying)
        try:
            yield self
        finally:
            _fake_cuda.REPLAY_HOOKS.remove(self._replaying)
            for graph in list(self.module.MALLOC_GRAPHS.values()):
                graph._comfy_active = False
            sys.modules.pop("comfy.model_prefetch", None)
            del comfy.model_prefetch

    def _replaying(self, starts: bool) -> None:
        """A graph replay (tests/_fake_cuda.py re-runs its ops): a GPU's allocates nothing."""
        graph = self._current()
        if graph is not None:
            graph.replaying += 1 if starts else -1

    def breaks(self) -> list[str]:
        return [b for r in self.recordings for b in r.breaks]
