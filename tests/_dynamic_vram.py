"""A CPU double of the newest ComfyUI's Dynamic VRAM (comfy-aimdo), over ComfyUI 0.8.0's real model
classes and patcher: the contract the pack meets on a GPU with a ComfyUI of February 2026 or newer, run here.

Each behaviour is read from the newest ComfyUI's files (Comfy-Org/ComfyUI; commits in
docs/comfyui-versions.md) and comfy-aimdo 0.6.0, and rewritten, not copied:
- ``comfy/ops.py`` (0271a469) ``cast_bias_weight``'s VBAR branch: a leaf with ``_v`` faults its VBAR
  slot. A slot still resident (same signature) hands out the views it handed out before
  (``_v_weight``); a slot just faulted in is filled from the CPU weight and keeps the LoRA-patched
  weight (``update_weight``); a fault that finds no room (signature None) copies the weight into
  the offload stream's one cast buffer at offset 0 (``cast_modules_with_vbar`` with one module), so
  the next cast on that stream overwrites it. ``uncast_bias_weight`` unpins the slot; a cast with
  ``offloadable=False`` returns no handle, so its pin is never released.
- ``comfy/model_management.py`` (02b2b388) ``get_offload_stream`` (2 streams, used in turn) and
  ``get_aimdo_cast_buffer`` (one buffer per stream).
- ``comfy/model_patcher.py`` (08d0e510) ``ModelPatcherDynamic``: ``load`` sets ``comfy_cast_weights``,
  ``seed_key``, ``_pin_state``, ``_v_signature`` (None when the patches changed) on every comfy op,
  gives ops over 16 KiB a VBAR slot ``_v`` and their LoRA as ``weight_lowvram_function``, and loads
  the small ones with the LoRA merged; ``partially_load`` returns None; ``patch_model(load_weights=True)``
  asserts; ``clone(disable_dynamic=True)`` is a plain ``ModelPatcher`` over another copy of the model
  (the checkpoint loaded again); ``get_non_dynamic_delegate`` returns one.
- comfy-aimdo's ``model_vbar.vbar_fault``, ``vbar_unpin`` and ``vbar_signature_compare`` are the real
  functions, called on :class:`CpuVBAR` (its ``ModelVBAR`` needs CUDA).

- ``get_offload_stream``'s rotation (the stream at the counter waits for the compute stream, the
  next is returned), ``sync_stream`` after a cast and ``uncast_bias_weight``'s wait of a filled slot's
  stream: told to a ``tests/_timeline.Timeline`` with each copy and pin, when one is set. With
  ``late`` copies, a copy lands only when the compute stream waits for its stream (NaN bytes till
  then): a read that skipped the wait reads garbage, as it may on a GPU; by default copies land
  when issued, so a buffer reused too early shows the later cast's bytes.

- comfy-aimdo's allocation hook (``src/pyt-cu-alloc.c``): with a :class:`Card` attached, each
  allocation first evicts the VBAR ranges it lacks room for, and runs out of memory when pinned
  ranges and live allocations leave none.

Left out: pinned host memory, the prefetch queue (no UNet opts in to ``prefetch_dynamic_vbars``),
the largest weight's second stream rotation, stream asynchrony itself (a CPU runs in order: the
double shows which memory is reused; the timeline computes when).
The CPU plays the GPU: the VBAR branch is taken whatever the device (ComfyUI's own CPU branch
returns copies, and ``ModelPatcherDynamic`` is never made for a CPU load device).
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SMALL = 16 * 1024      # ModelPatcherDynamic.load: ops of at most this many bytes are loaded, not given a slot
ALIGN = 512            # ModelVBAR.alloc's alignment, and the gathered weight/bias layout's here


#: ``offload``: this thread runs offload-stream work now (``cast_modules``' faults and copies), which
#: ComfyUI's recorder (tests/_comfy_compiler.py), recording the compute stream's allocations, skips
STREAM = threading.local()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _quantized(t) -> bool:
    return type(t).__name__ == "QuantizedTensor"


def _parts(t) -> list:
    """The tensors ``t``'s slot holds: a QuantizedTensor's inner ones (its raw bytes: data and scales,
    ``__tensor_flatten__``), else ``t``."""
    if t is None:
        return []
    if _quantized(t):
        names, _ = t.__tensor_flatten__()
        return [getattr(t, n) for n in names]
    return [t]


def _nbytes(t) -> int:
    return sum(p.numel() * p.element_size() for p in _parts(t))


def gathered_size(tensors) -> int:
    return sum(_aligned(p.numel() * p.element_size()) for t in tensors for p in _parts(t))


def geometries(leaf) -> list:
    """The weight and bias as their slot holds them (``tensors_to_geometries``): the op's model dtype
    (``<name>_comfy_model_dtype``, the dtype it was built in) where it has one, else the stored one."""
    out = []
    for key in ("weight", "bias"):
        t = getattr(leaf, key, None)
        if t is None or _quantized(t):         # (a QuantizedTensor is paged as it is)
            out.append(t)
            continue
        dtype = leaf.__dict__.get(f"{key}_comfy_model_dtype") or t.dtype
        out.append(torch.empty(t.shape, dtype=dtype, device="meta"))
    return out


class CpuVBAR:
    """comfy-aimdo's ``ModelVBAR`` over CPU memory, with aimdo's residency policy (its native library,
    ``src/model-vbar.c`` @ce3c59e3, at range granularity where aimdo keeps 32 MiB pages): ``alloc``
    hands out ``(vbar, address, size)``; ``fault`` makes a range resident and pins it, returning a
    signature (the same while the range stayed resident, a new one after it was evicted and faulted
    again) or None (VBAR_FAULT_OOM: the op streams). A fault of a range ending above the watermark
    fails; one that does not fit the room (``budget``: what the card leaves this model) evicts from
    the top of the VBAR down, lowering the watermark as it goes (pinned ranges stay, above it), and
    fails if the range is then above it; a deficit that pinned ranges keep takes the watermark to 0.
    So the lowest ranges stay resident and the rest stream, until ``prioritize`` (a load) puts the
    watermark back at the top. ``set_budget`` (another model took room) and ``free_memory`` evict
    from the top the same way; ``unpin`` frees a range left above the watermark. An evicted range
    is overwritten with NaN bytes, so a view read past its eviction reads garbage."""

    def __init__(self, size: int, budget: int):
        self.storage = torch.zeros(size, dtype=torch.uint8)
        self.max_size, self.offset, self.budget = size, 0, budget
        self.watermark = size
        self.resident: collections.OrderedDict = collections.OrderedDict()   # address -> (size, generation)
        self.pins: collections.Counter = collections.Counter()
        self._gen = itertools.count(1)
        self.faults = self.unpins = self.evictions = 0
        #: the device's memory shared with allocations (:class:`Card`), when one is attached
        self.card = None

    def alloc(self, num_bytes: int):
        self.offset = _aligned(self.offset)
        if self.offset + num_bytes > self.max_size:
            raise MemoryError("VBAR OOM")
        alloc = (self, self.offset, num_bytes)
        self.offset += num_bytes
        return alloc

    def used(self) -> int:
        return sum(size for size, _ in self.resident.values())

    def room(self) -> int:
        """What this VBAR may hold now: its budget, less what the card's allocations and other VBARs
        take (aimdo's ``budget_deficit``) where a :class:`Card` is attached."""
        if self.card is None:
            return self.budget
        return min(self.budget, self.card.size - self.card.held() - sum(v.used() for v in self.card.vbars if v is not self))

    def _evict(self, address: int) -> int:
        size, _ = self.resident.pop(address)
        self.storage[address:address + size].fill_(0xFF)
        self.evictions += 1
        return size

    def _lower(self, need: int, free: float | None = None) -> int:
        """Evict from the top down, the watermark following, until ``need`` more bytes fit the room
        (or, with ``free``, that many bytes are freed); a deficit left takes the watermark to 0."""
        freed = 0
        for address in sorted(self.resident, reverse=True):
            if (freed >= free) if free is not None else (self.used() + need <= self.room()):
                return freed
            self.watermark = min(self.watermark, address)
            if not self.pins[address]:
                freed += self._evict(address)
        if (freed < free) if free is not None else (self.used() + need > self.room()):
            self.watermark = 0
        return freed

    def prioritize(self) -> None:
        """``vbar_prioritize``: the whole range may be faulted again."""
        self.watermark = self.max_size

    def fault(self, address: int, size: int):
        self.faults += 1
        if address + size > self.watermark:
            return None
        if address not in self.resident:
            if self.used() + size > self.room():
                self._lower(size)
                if address + size > self.watermark or self.used() + size > self.room():
                    return None
            self.resident[address] = (size, next(self._gen))
        self.pins[address] += 1
        sig = (ctypes.c_uint32 * (size // (32 * 1024 ** 2) + 2))()
        sig[0], sig[1] = self.resident[address][1], address & 0xFFFFFFFF
        return sig

    def unpin(self, address: int, size: int) -> None:
        if not self.pins[address]:
            raise RuntimeError("VBAR unpin failed")
        self.pins[address] -= 1
        self.unpins += 1
        if not self.pins[address] and address >= self.watermark and address in self.resident:
            self._evict(address)

    def free_memory(self, size_bytes: float) -> int:
        return self._lower(0, free=size_bytes)

    def set_budget(self, budget: int) -> None:
        """Another model took (or gave back) room: evict from the top down to ``budget``."""
        self.budget = budget
        self._lower(0)

    def loaded_size(self) -> int:
        return self.used()

    def tensor(self, alloc) -> torch.Tensor:
        _, address, size = alloc
        return self.storage[address:address + size]

    def pinned(self) -> int:
        return sum(self.pins.values())


class Card:
    """The device's memory as comfy-aimdo shares it between its VBARs and torch's allocations (its
    allocator hook, ``aimdo_cuda_malloc_async`` in ``src/pyt-cu-alloc.c``): ``size`` bytes hold the
    attached VBARs' resident ranges and every live allocation. While :meth:`counting`, each storage
    an aten op returns that none of its inputs owns is an allocation on the device: it first evicts
    what it lacks from the VBARs (``vbars_free(budget_deficit(size))``: from the top of each, the
    watermark following, pinned ranges staying), and raises ``torch.OutOfMemoryError`` when pinned
    ranges and live allocations leave no room; its bytes come back when the storage is freed. A VBAR
    fault finds room only beside the live allocations (:meth:`CpuVBAR.room`). CUDA graphs
    (``tests/_fake_cuda.py``'s captures): what a capture allocates comes from one pool every capture
    shares, held from then on and as large as the largest capture's allocations (``pool``; the outputs
    earlier graphs keep in it are not counted); a replay allocates nothing."""

    def __init__(self, size: int):
        self.size, self.live, self.peak, self.pool = size, 0, 0, 0
        self.vbars: list = []
        self.evicted = self.ooms = 0
        self._replaying = 0
        self._capture: int | None = None      # bytes the running capture allocated

    def attach(self, vbar: CpuVBAR) -> Card:
        vbar.card = self
        if vbar not in self.vbars:
            self.vbars.append(vbar)
        return self

    def held(self) -> int:
        """Bytes the allocations hold now: live storages and the graphs' pool."""
        return self.live + max(self.pool, self._capture or 0)

    def allocate(self, nbytes: int) -> bool:
        """Room for ``nbytes`` made (VBAR ranges evicted) or OutOfMemoryError; whether the storage
        is the caller's to give back when freed (False: a replay's, or a capture's, in the pool)."""
        if self._replaying:
            return False
        grow = nbytes if self._capture is None else max(0, self._capture + nbytes - max(self.pool, self._capture))
        deficit = sum(v.used() for v in self.vbars) + self.held() + grow - self.size
        for vbar in self.vbars:
            if deficit <= 0:
                break
            freed = vbar.free_memory(deficit)
            self.evicted += freed
            deficit -= freed
        if deficit > 0:
            self.ooms += 1
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {nbytes} bytes (the double's card: {self.size} bytes, "
                f"{self.held()} allocated, {sum(v.used() for v in self.vbars)} of weights resident and pinned)")
        if self._capture is not None:
            self._capture += nbytes
        else:
            self.live += nbytes
        self.peak = max(self.peak, self.held())
        return self._capture is None

    def free(self, nbytes: int) -> None:
        self.live -= nbytes

    def _allocated(self, storage) -> None:
        if getattr(storage, "_card_counted", False):      # (counted when an earlier op made it)
            return
        storage._card_counted = True
        nbytes = storage.nbytes()
        if self.allocate(nbytes):
            weakref.finalize(storage, self.free, nbytes)

    def _replay(self, starts: bool) -> None:
        self._replaying += 1 if starts else -1

    def _captures(self, starts: bool) -> None:
        if starts:
            self._capture = 0
        else:
            self.pool, self._capture = max(self.pool, self._capture or 0), None

    @contextlib.contextmanager
    def counting(self):
        """This thread's allocations count on the card inside (the storages allocated here are
        given back when freed, inside or after)."""
        from . import _fake_cuda
        _fake_cuda.REPLAY_HOOKS.append(self._replay)
        _fake_cuda.CAPTURE_HOOKS.append(self._captures)
        try:
            with Allocations(self._allocated):
                yield self
        finally:
            _fake_cuda.REPLAY_HOOKS.remove(self._replay)
            _fake_cuda.CAPTURE_HOOKS.remove(self._captures)


class Allocations(TorchDispatchMode):
    """Calls ``on_alloc(storage)`` for each storage an op returns that none of its inputs owns (a
    view shares its base's): what the op allocated on the device."""

    def __init__(self, on_alloc):
        super().__init__()
        self.on_alloc = on_alloc

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        owned = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(a, torch.Tensor)}
        for t in outs:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().data_ptr() not in owned:
                owned.add(t.untyped_storage().data_ptr())
                self.on_alloc(t.untyped_storage())
        return out


class CudaVBAR:
    """comfy-aimdo's own ``ModelVBAR`` on a CUDA device behind :class:`CpuVBAR`'s interface, for the
    bench's rows on a GPU (``bench dynamic``): aimdo's native library maps, faults, pins and evicts;
    ``tensor`` is ``comfy_aimdo.torch.aimdo_to_tensor``; the budget is its watermark limit. What the
    tests read of :class:`CpuVBAR` (``resident``, ``pins``, ``pinned``) is not there: aimdo keeps it in C."""

    def __init__(self, size: int, budget: int, device: torch.device):
        import importlib

        import comfy_aimdo.control as control
        if control.lib is None:
            control.init()
        if control.lib is None:
            raise RuntimeError("comfy-aimdo's native library did not load (a CUDA driver and comfy-aimdo's wheel "
                               "for this platform are needed)")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if not control.devctxs:      # (ComfyUI's startup does this once; a second call only warns)
            control.init_device(index)
        # model_vbar binds ``control.lib`` when first imported: imported before the library loaded
        # (the double's CPU path imports it), its ``lib`` is None and ModelVBAR cannot call it
        import comfy_aimdo.model_vbar as model_vbar
        if model_vbar.lib is not control.lib:
            model_vbar = importlib.reload(model_vbar)
        self.device = torch.device("cuda", index)
        self.vbar = model_vbar.ModelVBAR(size, index)
        self.max_size, self.budget = size, budget
        self.set_budget(budget)

    def alloc(self, num_bytes: int):
        _, address, size = self.vbar.alloc(num_bytes)
        return (self, address, size)

    def fault(self, address: int, size: int):
        return self.vbar.fault(address, size)

    def unpin(self, address: int, size: int) -> None:
        self.vbar.unpin(address, size)

    def free_memory(self, size_bytes: float) -> int:
        return self.vbar.free_memory(int(min(size_bytes, 2**62)))

    def prioritize(self) -> None:
        """aimdo's ``ModelVBAR.prioritize`` (``vbar_prioritize``, no clamp): the whole range may be faulted again."""
        self.vbar.prioritize()

    def set_budget(self, budget: int) -> None:
        self.budget = budget
        self.vbar.set_watermark_limit(max(int(budget), 0))

    def loaded_size(self) -> int:
        return self.vbar.loaded_size()

    def tensor(self, alloc) -> torch.Tensor:
        from comfy_aimdo.torch import aimdo_to_tensor
        _, address, size = alloc
        return aimdo_to_tensor((self.vbar, address, size), self.device)


class DynamicVRAM:
    """The double, installed over ``comfy`` (0.8.0): ``comfy.ops.cast_bias_weight`` /
    ``uncast_bias_weight`` become the newest ones' VBAR branch for leaves with ``_v``; the plain
    path stays 0.8.0's. ``casts`` logs (thread id, leaf) per cast; ``shared_casts`` counts casts
    that went through a stream's shared buffer."""

    STREAMS = 2

    def __init__(self, comfy_ops):
        self.ops = comfy_ops
        self.original = (comfy_ops.cast_bias_weight, comfy_ops.uncast_bias_weight)
        self.buffers: dict[int, torch.Tensor] = {}
        self._stream = 0
        self._streams_made = False
        self.casts: list = []
        self.shared_casts = 0
        self.lock = threading.Lock()
        #: a ``tests/_timeline.Timeline`` told each copy, stream wait and pin (None: nothing recorded)
        self.timeline = None
        #: copies land when the compute stream waits for their stream (True), or when issued (False)
        self.late = False
        self._pending: dict = {}

    # -- comfy.model_management: get_offload_stream, sync_stream, get_aimdo_cast_buffer -----
    def offload_stream(self) -> int:
        """``get_offload_stream``: the stream at the counter waits for the compute stream ("sync the
        oldest stream in the queue with the current"), the counter moves on, and the stream it points
        at is returned; the first call makes the streams and waits on nothing."""
        if self._streams_made:
            self._wait(self._stream, "compute")
            self._stream = (self._stream + 1) % self.STREAMS
        self._streams_made = True
        return self._stream

    def _wait(self, waiter, on) -> None:
        """``waiter.wait_stream(on)`` (``on`` None: ``sync_stream``'s no-op). With ``late`` copies, the
        compute stream's wait is where an offload stream's copies land."""
        if on is None:
            return
        if self.timeline is not None:
            self.timeline.wait(waiter, on)
        if waiter == "compute":
            for dest, data in self._pending.pop(on, ()):
                dest.copy_(data)

    def cast_buffer(self, stream: int, size: int, device: torch.device) -> torch.Tensor:
        """``get_aimdo_cast_buffer``: ``stream``'s one buffer, on ``device`` (the op's), grown to ``size``."""
        buf, want = self.buffers.get(stream), torch.device("cpu" if device is None else device)
        moved = buf is not None and (buf.device.type != want.type or want.index not in (None, buf.device.index))
        if buf is None or moved or buf.numel() < size:
            buf = self.buffers[stream] = torch.empty(max(size, 1 << 20), dtype=torch.uint8, device=want)
        return buf

    # -- comfy.ops --------------------------------------------------------------------------
    def _write(self, tensors, dest: torch.Tensor, stream: int) -> None:
        """The host-to-device copy of ``tensors`` into ``dest``, issued on offload ``stream``: written now,
        or with ``late`` copies only when the compute stream waits for ``stream`` (:meth:`_wait`), the
        bytes there NaN till then, so a use before that wait reads garbage, as it may on a GPU."""
        with self.timeline.copy(stream, gathered_size(tensors)) if self.timeline else contextlib.nullcontext():
            target = torch.empty_like(dest) if self.late else dest
            at = 0
            for part in (p for t in tensors for p in _parts(t)):
                n = part.numel() * part.element_size()
                target[at:at + n].copy_(part.detach().contiguous().reshape(-1).view(torch.uint8))
                at += _aligned(n)
            if self.late:
                dest.fill_(0xFF)
                self._pending.setdefault(stream, []).append((dest, target))

    @staticmethod
    def _read(like, dest: torch.Tensor) -> list:
        """Views of ``dest`` shaped as ``like`` (``interpret_gathered_like``): a QuantizedTensor is
        rebuilt over views of its inner tensors (``__tensor_unflatten__``)."""
        out, at = [], 0
        for t in like:
            if t is None:
                out.append(None)
                continue
            views = []
            for part in _parts(t):
                n = part.numel() * part.element_size()
                views.append(dest[at:at + n].view(part.dtype).view(part.shape))
                at += _aligned(n)
            if _quantized(t):
                names, ctx = t.__tensor_flatten__()
                out.append(type(t).__tensor_unflatten__(dict(zip(names, views, strict=True)), ctx, t.shape, t.stride()))
            else:
                out.append(views[0])
        return out

    def cast_modules(self, leaves, device):
        """``cast_modules_with_vbar``: fault each leaf's slot; copy what is not resident into its
        slot, or into one stream's cast buffer from offset 0 when the fault found no room."""
        STREAM.offload = True
        try:
            return self._cast_modules(leaves, device)
        finally:
            STREAM.offload = False

    def _cast_modules(self, leaves, device):
        import comfy_aimdo.model_vbar as vbar
        stream, offset = None, 0
        for s in leaves:
            signature = vbar.vbar_fault(s._v)
            if signature is not None and self.timeline is not None:
                self.timeline.pin(s._v[2])
            resident = vbar.vbar_signature_compare(signature, s.__dict__.get("_v_signature"))
            prefetch = {"signature": signature, "resident": resident}
            if not resident:
                src = [s.weight, s.bias]
                size = gathered_size(src)
                stream = self.offload_stream() if stream is None else stream    # ensure_offload_stream
                # stored in another dtype than the slot's (needs_cast): the stored bytes go to the cast
                # buffer and resolve converts them into the slot (or, with no room, a new tensor)
                needs_cast = any(t is not None and t.dtype != g.dtype for t, g in zip(src, geometries(s), strict=True))
                slot = s._v[0].tensor(s._v) if signature is not None else None
                if slot is not None and not needs_cast:
                    dest = slot
                else:
                    dest = self.cast_buffer(stream, offset + size, device)[offset:offset + size]
                    offset += size
                    self.shared_casts += 1
                self._write(src, dest, stream)
                prefetch.update(dest=dest, cast_dest=slot if needs_cast else None, needs_cast=needs_cast)
            s._prefetch = prefetch
        return stream

    def resolve(self, s, dtype, bias_dtype, compute_dtype):
        """``resolve_cast_module_with_vbar``: the views of what ``cast_modules`` placed, each cast to
        the compute dtype, its LoRA applied when the slot was (re)filled and written back to it."""
        prefetch = s._prefetch
        if prefetch["resident"]:
            weight, bias = s._v_weight, s._v_bias
        else:
            placed = self._read([s.weight, s.bias], prefetch["dest"])
            if prefetch["needs_cast"]:        # converted into the slot's dtype: the slot, or a new tensor
                geoms = geometries(s)
                dest = prefetch["cast_dest"]
                if dest is None:
                    dest = torch.empty(gathered_size(geoms), dtype=torch.uint8, device=prefetch["dest"].device)
                converted = self._read(geoms, dest)
                for pre, post_cast in zip(placed, converted, strict=True):
                    if post_cast is not None:
                        post_cast.copy_(pre)
                placed = converted
            weight, bias = placed
            if prefetch["signature"] is not None:
                s._v_weight, s._v_bias = weight, bias
            s._v_signature = prefetch["signature"]

        def post(key, x, dt):
            if x is None:
                return None
            lowvram = getattr(s, key + "_lowvram_function", None)
            fns = getattr(s, key + "_function", [])
            orig = x
            if orig.dtype != dt or fns:
                x = x.to(dt)
            if not prefetch["resident"] and lowvram is not None:
                x = lowvram(x.to(dt if compute_dtype is None else compute_dtype))
                if prefetch["signature"] is not None:
                    orig.copy_(x.to(orig.dtype))
            for f in fns:
                x = f(x)
            return x
        weight = post("weight", weight, dtype)
        bias = post("bias", bias, bias_dtype)
        if prefetch["signature"] is not None:
            prefetch["resident"] = True
        return weight, bias

    def cast_bias_weight(self, s, input=None, dtype=None, device=None, bias_dtype=None, offloadable=False,
                         compute_dtype=None, want_requant=False):
        if input is not None:
            dtype = input.dtype if dtype is None else dtype
            bias_dtype = dtype if bias_dtype is None else bias_dtype
            device = input.device if device is None else device
        if "_v" not in s.__dict__:       # a loaded op (no slot): ComfyUI's plain path
            return self.original[0](s, input, dtype=dtype, device=device, bias_dtype=bias_dtype,
                                    offloadable=offloadable)
        with self.lock:
            self.casts.append((threading.get_ident(), s))
        prefetched = "_prefetch" in s.__dict__
        stream = None if prefetched else self.cast_modules([s], device)
        if not prefetched:
            self._wait("compute", stream)                  # sync_stream(device, offload_stream)
        weight, bias = self.resolve(s, dtype, bias_dtype, compute_dtype)
        handle = (stream, None, None)
        if not prefetched:
            if s._prefetch["signature"] is not None:
                handle = (stream, device, None)      # the device in weight_a's place: "unpin the slot"
            del s._prefetch
        return (weight, bias, handle) if offloadable else (weight, bias)

    def uncast_bias_weight(self, s, weight, bias, offload_stream):
        if offload_stream is None:
            return
        stream, weight_a, _ = offload_stream
        if weight_a is not None and not isinstance(weight_a, torch.Tensor):
            # a slot (resident or filled this cast): unpinned; its stream, if it copied, waits for the op
            import comfy_aimdo.model_vbar as vbar
            vbar.vbar_unpin(s._v)
            if self.timeline is not None:
                self.timeline.unpin(s._v[2])
            if stream is not None:
                self._wait(stream, "compute")
            return
        if "_v" not in s.__dict__:
            self.original[1](s, weight, bias, offload_stream)

    @contextlib.contextmanager
    def installed(self):
        self.ops.cast_bias_weight, self.ops.uncast_bias_weight = self.cast_bias_weight, self.uncast_bias_weight
        try:
            yield self
        finally:
            self.ops.cast_bias_weight, self.ops.uncast_bias_weight = self.original


def dynamic_patcher_class(comfy):
    """``ModelPatcherDynamic``'s contract as a subclass of this ComfyUI's ``ModelPatcher``."""
    import comfy.model_patcher as mp
    import comfy.utils

    class DynamicPatcher(mp.ModelPatcher):
        #: the VBAR's room as a fraction of the slotted bytes (1: all resident; 0: every cast shared)
        budget = 0.5
        small = SMALL
        cached_patcher_init = None
        #: the dtype slotted ops' weights are stored in on the CPU (None: the model's own); their slots
        #: hold the model's dtype, converted into at each fill
        stored = None

        def is_dynamic(self):
            return True

        def vbar(self) -> CpuVBAR:
            vbars = self.model.__dict__.setdefault("dynamic_vbars", {})
            key = str(self.load_device)
            if key not in vbars:
                size = 2 * self.model_size() + (1 << 20)
                vbars[key] = (CudaVBAR(size, 0, self.load_device) if self.load_device.type == "cuda"
                              else CpuVBAR(size, 0))
            return vbars[key]

        def _restore_loaded(self) -> None:
            for key in list(self.backup):
                comfy.utils.set_attr_param(self.model, key, self.backup.pop(key).weight)
            self.model.model_loaded_weight_memory = 0

        def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False,
                 dirty=False):
            assert not force_patch_weights and not full_load
            self._restore_loaded()
            vbar = self.vbar()
            slotted = 0
            for n, m in self.model.named_modules():
                if not hasattr(m, "comfy_cast_weights"):
                    continue
                m.comfy_cast_weights = True
                m.seed_key = n
                m._pin_state = {"fast_disk": False}
                if dirty or not hasattr(m, "_v_signature"):
                    m._v_signature = None
                own = [(k, p) for k, p in (("weight", m.weight), ("bias", getattr(m, "bias", None))) if p is not None]
                # (quantized weights are paged too, as their raw bytes)
                if sum(_nbytes(p) for _, p in own) > self.small:
                    for key, _ in own:
                        full = f"{n}.{key}"
                        setattr(m, key + "_lowvram_function",
                                mp.LowVramPatch(full, self.patches) if full in self.patches else None)
                        setattr(m, key + "_function", list(self.weight_wrapper_patches.get(full, [])))
                    if self.stored is not None:      # the checkpoint's tensors kept as loaded (the lazy ops)
                        for key, p in own:
                            if p.dtype != self.stored:
                                m.__dict__[f"{key}_comfy_model_dtype"] = p.dtype
                                m._parameters[key] = torch.nn.Parameter(p.detach().to(self.stored), requires_grad=False)
                    if "_v" not in m.__dict__:
                        m._v = vbar.alloc(gathered_size([g for g in geometries(m) if g is not None]))
                    slotted += m._v[2]
                else:
                    for key, _ in own:
                        self.patch_weight_to_device(f"{n}.{key}", device_to)
                        setattr(m, key + "_function", list(self.weight_wrapper_patches.get(f"{n}.{key}", [])))
                    self.model.model_loaded_weight_memory += sum(_nbytes(p) for _, p in own)
            vbar.prioritize()          # (the model is active again: its whole range may be faulted)
            vbar.set_budget(int(self.budget * slotted))
            self.model.device = device_to
            self.model.current_weight_patches_uuid = self.patches_uuid
            for callback in self.get_all_callbacks(mp.CallbacksMP.ON_LOAD):
                callback(self, device_to, lowvram_model_memory, force_patch_weights, full_load)

        def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
            assert not force_patch_weights
            uuid = self.model.current_weight_patches_uuid
            dirty = uuid is not None and uuid != self.patches_uuid
            self.unpatch_model(self.offload_device, unpatch_weights=False)
            self.patch_model(load_weights=False)
            self.load(device_to, dirty=dirty)
            return None

        def patch_model(self, device_to=None, lowvram_model_memory=0, load_weights=True, force_patch_weights=False):
            assert not load_weights
            return super().patch_model(load_weights=False, force_patch_weights=force_patch_weights)

        def unpatch_model(self, device_to=None, unpatch_weights=True):
            super().unpatch_model(None, unpatch_weights=False)
            if unpatch_weights:
                self.vbar().free_memory(1e32)
                self._restore_loaded()

        def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
            freed = self.vbar().free_memory(memory_to_free)
            if freed < memory_to_free:
                freed += self.model.model_loaded_weight_memory
                self._restore_loaded()
            return freed

        def get_free_memory(self, device):
            """``ModelPatcher.get_free_memory`` (newer ComfyUI, model_patcher.py @08d0e510): the module's
            ``get_free_memory`` plus what aimdo's VBARs could give back (``vbars_analyze``: here the
            resident ranges no call has pinned), which the module-level count leaves out."""
            import comfy.model_management
            vbar = self.vbar()
            if not isinstance(vbar, CpuVBAR):         # aimdo's own count on a GPU (it takes the device's index)
                import comfy_aimdo.model_vbar as model_vbar
                return comfy.model_management.get_free_memory(device) + model_vbar.vbars_analyze(vbar.device.index)
            return comfy.model_management.get_free_memory(device) + sum(size for address, (size, _) in vbar.resident.items()
                                                    if not vbar.pins[address])

        def loaded_size(self):
            return self.vbar().loaded_size() + self.model.model_loaded_weight_memory

        def clone(self, disable_dynamic=False, model_override=None, force_deepcopy=False):
            if not disable_dynamic:
                n = super().clone()
                n.budget, n.small, n.cached_patcher_init, n.stored = (self.budget, self.small,
                                                                      self.cached_patcher_init, self.stored)
                return n
            # a plain ModelPatcher over the checkpoint loaded again (cached_patcher_init): another
            # module with the same weights and no dynamic state
            cls = self.__class__
            self.__class__ = mp.ModelPatcher
            try:
                n = self.clone()
            finally:
                self.__class__ = cls
            if model_override is None:
                if self.cached_patcher_init is None:
                    raise RuntimeError("Cannot create non-dynamic delegate: cached_patcher_init is not initialized.")
                model_override = self.cached_patcher_init().model
            n.model = model_override
            n.backup, n.object_patches_backup = {}, {}
            return n

        def get_non_dynamic_delegate(self):
            n = self.clone(disable_dynamic=True, model_override=self.__dict__.get("_delegate_model"))
            self._delegate_model = n.model
            return n

    return DynamicPatcher


def make_dynamic(comfy, mp, budget: float = 0.5, small: int = SMALL, reload=None, stored=None):
    """A dynamic patcher over ``mp``'s model (``mp`` a plain 0.8.0 ``ModelPatcher``): its VBAR holds
    ``budget`` of the slotted bytes; ops of at most ``small`` bytes are loaded instead. ``reload()``
    loads the checkpoint again as a plain ``ModelPatcher`` (``cached_patcher_init``: what
    ``clone(disable_dynamic=True)`` samples). ``stored``: the dtype the slotted ops' weights are kept
    in on the CPU (the checkpoint's: fp32 under a bf16 model), their slots in the model's dtype."""
    cls = dynamic_patcher_class(comfy)
    d = cls(mp.model, mp.load_device, mp.offload_device, mp.model_size())
    d.budget, d.small, d.cached_patcher_init, d.stored = budget, small, reload, stored
    return d


def newest_mixed_precision(leaf) -> None:
    """Give a 0.8.0 mixed-precision Linear the newest ComfyUI's forward rule (comfy/ops.py 0271a469,
    ``_use_quantized``): the quantized matmul unless the leaf dequantizes (``_full_precision_mm``),
    is forced to cast or has weight functions; ``comfy_cast_weights``, which Dynamic VRAM sets on
    every op, is not read. The input is quantized to the layout as ComfyUI's does, and the weights
    come through ``cast_bias_weight`` (a paged QuantizedTensor from its VBAR slot), as the newest
    forward takes them on every path."""
    import comfy.ops
    from comfy.quant_ops import QuantizedTensor

    from ._written import as_written

    def forward(self, input, *args, **kwargs):
        use_quantized = (getattr(self, "layout_type", None) is not None and not self._full_precision_mm
                         and not getattr(self, "comfy_force_cast_weights", False)
                         and len(self.weight_function) == 0 and len(self.bias_function) == 0)
        if not use_quantized or input.ndim < 2:
            return self.forward_comfy_cast_weights(input)
        shape = input.shape
        q = QuantizedTensor.from_float(input.reshape(-1, shape[-1]), self.layout_type,
                                       scale=getattr(self, "input_scale", None))
        weight, bias, handle = comfy.ops.cast_bias_weight(self, input, offloadable=True)
        try:
            return self._forward(q, weight, bias).reshape(*shape[:-1], weight.shape[0])
        finally:
            comfy.ops.uncast_bias_weight(self, weight, bias, handle)
    cls = type(leaf)
    # ComfyUI's own forward, written in its class as the pack sees it
    leaf.__class__ = as_written(type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                                            "__qualname__": cls.__qualname__}))
    leaf._full_precision_mm = False
