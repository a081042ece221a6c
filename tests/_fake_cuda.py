"""A stand-in for the ``torch.cuda`` surface the pack's production ``CudaGraphs`` (compiler/graphs.py)
calls, so that code runs on a machine without a GPU: streams and the stream context, the current
device (``set_device``, the ``device`` context), synchronize, capture flags, a graph pool handle,
the card's properties and free memory, empty_cache, and ``CUDAGraph`` whose capture records the aten
ops run between ``capture_begin`` and ``capture_end`` (refusing host syncs and random ops, as
tests/conftest.py's StrictGraphStandIn does) and whose replay re-runs them on the captured tensors.
CPU tensors stand for device tensors: only ``CudaGraphs.usable``'s "is this tensor on CUDA" cannot
be faked and is answered by the test.
As CUDA keeps them, the current device, the current stream and a running capture are each thread's
own (ComfyUI's multi-GPU pool threads each set their device; a capture in ``thread_local`` mode
records only its own thread's work).

A Triton kernel launched inside a capture (the interpreter's, on CPU tensors) is recorded as one op
and launched again by a replay, as a real graph holds the kernel. A JIT launch returns what triton's
JIT returns on a GPU, a compiled kernel (:class:`Compiled`), whose ``run`` takes arguments as
triton's launcher does (triton 3.9 ``CudaLauncher``; ``extractPointer`` in its driver.c): a pointer
given as an int is taken as is, a tensor goes through the pointer check; the kernel then runs under
the interpreter on the memory at those addresses, on the stream it was given (which must be the
current one, ``torch._C._cuda_getCurrentRawStream``). ``allocator="cudaMallocAsync"``
(ComfyUI's default) adds what the H100 run showed (docs/gpu.md):
memory a capture allocates there is a graph allocation that Triton's launcher cannot take, so a Triton
kernel (the interpreter's launch, patched) given such a tensor inside a capture raises triton's
ValueError, and ``aborted`` records it: the real process then dies with SIGABRT.

    with fake_cuda(monkeypatch, total=24 << 30, free=20 << 30) as cuda: ...   # cuda.log: what was called
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
from collections import Counter

import torch

from ._dynamic_vram import Allocations

REFUSED = ("_local_scalar_dense", "is_nonzero", "item", "rand", "randn", "randint", "normal", "bernoulli",
           "multinomial", "uniform_", "normal_", "nonzero", "unique")


class CaptureError(RuntimeError):
    """What a real capture raises on a host sync or a random op inside it."""


def _tensors(o):
    return [t for t in ((o,) if isinstance(o, torch.Tensor) else o) if isinstance(t, torch.Tensor)]


class _Record(Allocations):
    """A capture's recorder: refuses host syncs and random ops, keeps every op for the replays, and
    tells ``allocated`` (a set of data_ptrs, when tracked) and ``on_alloc`` (bytes) of each storage
    the capture allocates, once (``Allocations``' rule: one that none of an op's inputs owns)."""

    def __init__(self, ops, allocated: set | None = None, on_alloc=None):
        super().__init__(self._allocated)
        self.ops, self.allocated, self.on_bytes = ops, allocated, on_alloc
        self._seen: set = set()

    def _allocated(self, storage) -> None:
        ptr = storage.data_ptr()
        if ptr in self._seen:
            return
        self._seen.add(ptr)
        if self.allocated is not None:
            self.allocated.add(ptr)
        if self.on_bytes is not None:
            self.on_bytes(storage.nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in REFUSED:
            raise CaptureError(f"operation not permitted when stream is capturing ({name})")
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


#: called with True at each replay's start and False at its end (tests/_timeline.py: one graph launch)
REPLAY_HOOKS: list = []
#: called with True at each capture's start and False at its end (tests/_dynamic_vram.Card: its pool)
CAPTURE_HOOKS: list = []


def _captures(starts: bool) -> None:
    for hook in CAPTURE_HOOKS:
        hook(starts)


def replay(ops) -> None:
    """Re-run recorded ops on the captured tensors, each result written into the tensor the capture
    recorded (graph memory): a view aliases its base, which its own op refreshed; an op that may view
    or copy (reshape, contiguous) is a view only where it shares its input's memory."""
    for hook in REPLAY_HOOKS:
        hook(True)
    try:
        _replay(ops)
    finally:
        for hook in REPLAY_HOOKS:
            hook(False)


def _replay(ops) -> None:
    for func, args, kwargs, recorded in ops:
        fresh = func(*args, **kwargs)
        if not isinstance(recorded, (torch.Tensor, tuple, list)):
            continue
        bases = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        # (the write-back is this stand-in's, not a device op: out of sight of a recording mode)
        with torch.utils._python_dispatch._disable_current_modes():
            for r, f in zip(_tensors(recorded), _tensors(fresh), strict=True):
                if r is not f and r.untyped_storage().data_ptr() not in bases:
                    r.copy_(f)


def record(fn, ops: list):
    """``fn()`` with every aten op it runs appended to ``ops`` (CaptureError on a host sync or a
    random op); returns its result."""
    _captures(True)
    try:
        with _Record(ops):
            return fn()
    finally:
        _captures(False)


class FakeCUDA:
    """The faked surface; ``log`` counts the calls, ``capturing`` is the capture flag."""

    def __init__(self, total: int, free: int, allocator: str = "native"):
        self.total, self.free = total, free
        self.allocator = allocator
        self.log: Counter = Counter()
        self.pools = 0
        #: every capture's allocations (tracked under cudaMallocAsync)
        self.captured: set = set()
        #: why the real process would have aborted (a Triton launch on capture-allocated memory)
        self.aborted: str | None = None
        #: per thread, as CUDA keeps them: the current device, its stream stack, whether a capture runs
        #: on it (``capturing``), the running capture's op list (``recording``: a Triton launch inside
        #: it is recorded as one op) and what that capture allocated (``capture_allocated``)
        self._thread = threading.local()
        #: torch.cuda.memory_reserved(): grows by what each capture allocates (its private pool, which a
        #: real capture never gives back until the graphs are freed and the cache emptied)
        self.reserved = 0
        #: Triton launches through the JIT (a direct launch of a compiled kernel is counted by it)
        self.jit_launches = 0
        self._default = self.Stream()
        fake = self

        class CUDAGraph:
            def __init__(self):
                self.ops, self._mode = [], None

            def capture_begin(self, pool=None, capture_error_mode="global"):
                fake.log["capture_begin"] += 1
                _captures(True)
                fake.capturing = True
                self.pool = pool
                fake.capture_allocated.clear()
                fake.recording = self.ops
                self._mode = _Record(self.ops, fake.capture_allocated if fake.allocator == "cudaMallocAsync" else None,
                                     on_alloc=fake._grow)
                self._mode.__enter__()

            def capture_end(self):
                fake.log["capture_end"] += 1
                fake.captured |= fake.capture_allocated
                self._mode.__exit__(None, None, None)
                fake.capturing, fake.recording = False, None
                _captures(False)

            def replay(self):
                fake.log["replay"] += 1
                replay(self.ops)
        self.CUDAGraph = CUDAGraph

    class Stream:
        def __init__(self, device=None):
            self.device = device
            self.cuda_stream = id(self)   # the raw handle triton's launches name

        def wait_stream(self, other):
            pass

        def synchronize(self):
            pass

    def _here(self):
        """This thread's CUDA state (device 0 and the default stream on a new thread)."""
        t = self._thread
        if not hasattr(t, "streams"):
            t.device, t.streams, t.capturing, t.recording, t.capture_allocated = 0, [self._default], False, None, set()
        return t

    capturing = property(lambda self: self._here().capturing, lambda self, v: setattr(self._here(), "capturing", v))
    recording = property(lambda self: self._here().recording, lambda self, v: setattr(self._here(), "recording", v))
    capture_allocated = property(lambda self: self._here().capture_allocated)

    def current_stream(self, device=None):
        return self._here().streams[-1]

    def raw_stream(self, device=None) -> int:
        """``torch._C._cuda_getCurrentRawStream``: the current stream's handle."""
        return self._here().streams[-1].cuda_stream

    @contextlib.contextmanager
    def stream(self, s):
        self.log["stream"] += 1
        streams = self._here().streams
        streams.append(s)
        try:
            yield
        finally:
            streams.pop()

    def current_device(self):
        return self._here().device

    def set_device(self, device) -> None:
        """``torch.cuda.set_device``: an index or a ``torch.device`` (its index) for this thread."""
        self._here().device = device.index if isinstance(device, torch.device) else int(device)

    @contextlib.contextmanager
    def device(self, device):
        """``torch.cuda.device(d)``: ``d`` this thread's current device for the block."""
        here = self._here()
        before = here.device
        self.set_device(device)
        try:
            yield
        finally:
            here.device = before

    def synchronize(self, device=None):
        self.log["synchronize"] += 1

    def is_current_stream_capturing(self):
        return self.capturing

    def graph_pool_handle(self):
        self.pools += 1
        return (0, self.pools)

    def get_device_properties(self, device=None):
        return type("Props", (), {"total_memory": self.total, "name": "fake GPU"})()

    def mem_get_info(self, device=None):
        return self.free, self.total

    def empty_cache(self):
        self.log["empty_cache"] += 1

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes

    def memory_reserved(self, device=None):
        return self.reserved

    def triton_pointer_check(self, args) -> None:
        """What triton's launcher does with each pointer argument (cuPointerGetAttribute): under
        cudaMallocAsync, memory a running capture allocated is refused."""
        if not (self.capturing and self.allocator == "cudaMallocAsync"):
            return
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.capture_allocated:
                self.aborted = f"a Triton launch inside a capture on capture-allocated memory (argument {i})"
                raise ValueError(f"Pointer argument (at {i}) cannot be accessed from Triton (cpu tensor?)")


class Compiled:
    """What triton's JIT launch returns on a GPU: the compiled kernel, for the launch's specialisation.
    ``run(gridX, gridY, gridZ, stream, function, packed_metadata, launch_metadata, enter_hook,
    exit_hook, *args)`` takes every parameter in order (constexprs included, as the JIT passes them);
    ``launches`` counts its direct launches (not the JIT's); the fake's log counts those a capture
    recorded (``kernel_captured``) and those its replays launched again (``kernel_replayed``)."""

    def __init__(self, fake: FakeCUDA, fn, launch, args, kwargs):
        names = list(fn.arg_names)
        given = {**dict(zip(names, args, strict=False)), **kwargs}
        #: pointer parameters (position -> dtype), from the tensors the JIT launch was given
        self.pointers = {i: given[n].dtype for i, n in enumerate(names) if isinstance(given.get(n), torch.Tensor)}
        self.fake, self.fn, self._launch, self.nparams = fake, fn, launch, len(names)
        self.function, self.packed_metadata = object(), object()
        self.launches = 0

    def run(self, grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata, enter_hook,
            exit_hook, *args):
        if len(args) != self.nparams or function is not self.function or packed_metadata is not self.packed_metadata:
            raise TypeError(f"{self.fn.__name__}: launched with {len(args)} arguments for {self.nparams} parameters, "
                            f"or another kernel's function / metadata")
        if stream != self.fake.raw_stream():
            raise RuntimeError(f"{self.fn.__name__}: launched on a stream that is not the current one")
        self.fake.triton_pointer_check(args)    # tensors only: an int is taken as it is
        self.launches += 1
        fake, fn, launch, pointers = self.fake, self.fn, self._launch, self.pointers

        def go():
            vals = [_at(a, pointers[i]) if i in pointers and isinstance(a, int) else a for i, a in enumerate(args)]
            launch(fn, *vals, grid=(grid_x, grid_y, grid_z), warmup=False)
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes():
            go()
        if fake.recording is not None:
            fake.log["kernel_captured"] += 1

            def replayed(*a, **k):
                fake.log["kernel_replayed"] += 1
                go()
            fake.recording.append((replayed, (), {}, None))


def _at(address: int, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor at ``address`` (the interpreter reads and writes through its address)."""
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_byte * size).from_address(address), dtype=dtype)


@contextlib.contextmanager
def fake_cuda(monkeypatch, total: int = 24 << 30, free: int = 20 << 30, allocator: str = "native"):
    """torch.cuda's names that compiler/graphs.py calls, faked for the block (``monkeypatch`` undoes it);
    ``allocator``: what ``torch.cuda.memory.get_allocator_backend()`` answers (and, for
    cudaMallocAsync, triton's pointer check inside a capture on the interpreter's launches)."""
    from torch._inductor.codecache import CacheBase
    CacheBase.get_system()    # (cached: inductor's key of this machine, before its CUDA queries meet the fake)
    fake = FakeCUDA(total, free, allocator)
    for name in ("Stream", "current_stream", "stream", "current_device", "set_device", "device", "synchronize",
                 "is_current_stream_capturing", "graph_pool_handle", "get_device_properties", "mem_get_info",
                 "empty_cache", "CUDAGraph", "memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", fake.raw_stream, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: fake.allocator)
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime.interpreter import InterpretedFunction
    launch = InterpretedFunction.run

    def launched(self, *args, **kwargs):
        """A Triton launch (the interpreter's): inside a capture, one recorded op that a replay launches
        again on the captured tensors (not the interpreter's own host copies), after triton's pointer
        check; returns the compiled kernel (:class:`Compiled`) as triton's JIT does on a GPU."""
        if fake.allocator == "cudaMallocAsync":
            fake.triton_pointer_check(list(args) + list(kwargs.values()))
        if fake.recording is None:
            launch(self, *args, **kwargs)
        else:
            with _disable_current_modes():
                launch(self, *args, **kwargs)
            fake.recording.append((lambda *a, **k: launch(self, *a, **k), args, kwargs, None))
        fake.jit_launches += 1
        if kwargs.get("warmup"):
            return None
        grid_free = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
        return Compiled(fake, self, launch, args, grid_free)
    monkeypatch.setattr(InterpretedFunction, "run", launched)
    forget_launches()
    try:
        yield fake
    finally:
        forget_launches()


def forget_launches() -> None:
    """Drop the kernels' plans, whose launches may hold this fake's compiled kernels (a process
    keeps them; a test outside the fake must not launch them)."""
    import importlib
    for name in ("attention", "epilogue", "geglu", "groupnorm"):
        importlib.import_module(f"unet_compiler.kernels.{name}")._PLANS.clear()
