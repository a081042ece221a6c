"""Shared launcher helpers. Imports torch only, never triton, so the backend can
catch :class:`KernelUnsupported` without triton installed."""
from __future__ import annotations

import threading

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Offsets inside the kernels are 32-bit; bigger tensors go eager. The margin leaves room
# for the masked lanes of a last block, whose offsets run up to one block past the end:
# a 1-D block (<= 4096 elements) always fits; a tile of rows is checked by check_row_block.
OFFSET_MARGIN = 2**24
MAX_NUMEL = 2**31 - 1 - OFFSET_MARGIN


# (major, minor) of a GPU to compile for on a machine without one (bench/targets.py sets it,
# with a driver that turns launches into compiles): launchers then take CPU tensors and choose
# as they would on that GPU. None (always, outside that script): the tensors' own device decides.
COMPILE_TARGET: tuple[int, int] | None = None


class KernelUnsupported(ValueError):
    """A launcher cannot run these inputs (size, dtype, device, layout). The
    message is one sentence naming the input and why; the caller runs that
    region eager instead."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints on the host. Launchers use it, not ``triton.cdiv``, which in
    triton 3.6+ is a constexpr function costing microseconds per host call."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` was built under TRITON_INTERPRET=1 (runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def gpu_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability the kernels compile for on ``device``; None off CUDA
    (the interpreter)."""
    if COMPILE_TARGET is not None:
        return COMPILE_TARGET
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def check_tensor(kernel_name: str, arg: str, t, kernel, *, device=None, dtypes=FLOAT_DTYPES,
                 ndim_min: int = 0) -> None:
    """Raise KernelUnsupported unless ``t`` is a tensor this kernel can read."""
    if not isinstance(t, torch.Tensor):
        raise KernelUnsupported(f"{kernel_name}: `{arg}` is a {type(t).__name__}, not a torch.Tensor.")
    if t.dtype not in dtypes:
        names = "/".join(str(d).replace("torch.", "") for d in dtypes)
        raise KernelUnsupported(f"{kernel_name}: `{arg}` has dtype {str(t.dtype).replace('torch.', '')}; "
                                f"the kernel supports {names}.")
    if t.dim() < ndim_min:
        raise KernelUnsupported(f"{kernel_name}: `{arg}` has {t.dim()} dims; the kernel needs at least {ndim_min}.")
    span = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True) if n > 0)
    if t.numel() > MAX_NUMEL or span > MAX_NUMEL:
        raise KernelUnsupported(f"{kernel_name}: `{arg}` spans {span} elements; the kernel uses 32-bit offsets "
                                f"(at most {MAX_NUMEL}).")
    if t.requires_grad and torch.is_grad_enabled():
        raise KernelUnsupported(f"{kernel_name}: `{arg}` requires grad with autograd enabled; the kernels are "
                                f"forward-only (run under torch.no_grad() or torch.inference_mode()).")
    if device is not None and t.device != device:
        raise KernelUnsupported(f"{kernel_name}: `{arg}` is on {t.device} but the input is on {device}.")
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and (is_interpreted(kernel) or COMPILE_TARGET is not None):
        return
    raise KernelUnsupported(f"{kernel_name}: `{arg}` is on {t.device}; the Triton kernels run on CUDA tensors "
                            f"(CPU tensors only under TRITON_INTERPRET=1, set before triton is imported).")


def tensor_key(t) -> tuple | None:
    """What a launcher's checks read of an argument: a tensor's shape, strides, dtype, device and
    whether it needs grad now (:func:`check_tensor`); anything else by its type."""
    if isinstance(t, torch.Tensor):
        return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad and torch.is_grad_enabled())
    return None if t is None else (type(t),)


class Plans(dict):
    """A launcher's plans: input signature (its :func:`tensor_key`s and scalar arguments, plus
    COMPILE_TARGET) -> what its checks and launch arithmetic produced, so a call at a signature met
    before skips both. Bounded: full, it starts over."""

    LIMIT = 512

    def key(self, *parts) -> tuple:
        return (COMPILE_TARGET, *parts)

    def put(self, key, plan):
        if len(self) >= self.LIMIT:
            self.clear()
        try:
            self[key] = plan
        except TypeError:   # an unhashable scalar argument: planned again next time
            pass
        return plan

    def find(self, key):
        try:
            return self.get(key)
        except TypeError:
            return None


class NotBound(KernelUnsupported):
    """A launch inside a CUDA graph capture under cudaMallocAsync that would have to go through
    triton's JIT (no compiled kernel for it yet, or pointers the compiled one cannot take): nothing
    was launched. The caller runs the torch ops it replaces for this call; later calls are not
    affected."""


#: whether planned launches may launch their compiled kernel directly (False: every launch goes
#: through triton's JIT; set by :func:`bound_launch_problem` when the check below fails)
BIND = [True]
_BIND_CHECKED: list = []   # [None] once the check passed, [why] once it failed
_BIND_LOCK = threading.RLock()


def _capturing() -> bool:
    """Whether a CUDA graph capture under the cudaMallocAsync allocator is running, where a JIT
    launch (its pointer check) refuses the capture's memory and the process aborts. Under the
    native allocator a capture may hold a JIT launch."""
    try:
        return torch.cuda.is_current_stream_capturing() and \
            torch.cuda.memory.get_allocator_backend() == "cudaMallocAsync"
    except (AssertionError, RuntimeError):   # a torch without CUDA
        return False


class Launch:
    """One launch of a kernel at one input signature (held by a launcher's plan): its grid, the
    scalar arguments after the tensors and the constexprs / launch options, all fixed; a call gives
    the tensors (pointer arguments, first in every kernel of the pack). The first call goes through
    triton's JIT (checks, specialisation, compile, cache) and keeps the compiled kernel it returns;
    later calls launch that kernel on the current stream with the tensors' addresses as integers,
    which triton's launcher takes as they are: no JIT dispatch (tens of µs a call), and no
    ``cuPointerGetAttribute``, which refuses memory a CUDA graph capture allocated under the
    cudaMallocAsync allocator. A call whose pointers break the 16-byte alignment the compiled kernel
    was specialised for, or made while launch hooks (a profiler's) are registered, goes through the
    JIT again; inside a capture under cudaMallocAsync nothing goes through the JIT
    (:class:`NotBound`)."""

    __slots__ = ("kernel", "grid", "args", "kw", "compiled", "tail", "aligned", "grid3", "device", "rt")

    def __init__(self, kernel, grid: tuple, args: tuple = (), kw: dict | None = None):
        self.kernel, self.grid, self.args, self.kw = kernel, tuple(grid), tuple(args), dict(kw or {})
        self.compiled = None
        self.grid3 = (*self.grid, 1, 1)[:3]

    def __call__(self, *tensors) -> None:
        c = self.compiled
        if c is not None and BIND[0]:
            ptrs = [t.data_ptr() for t in tensors]
            low = 0
            for i in self.aligned:
                low |= ptrs[i]
            rt = self.rt
            enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
            if not low & 15 and not getattr(enter, "calls", enter) and not getattr(leave, "calls", leave):
                c.run(*self.grid3, torch._C._cuda_getCurrentRawStream(self.device), c.function,
                      c.packed_metadata, None, None, None, *ptrs, *self.tail)
                return
        if _capturing():
            raise NotBound(f"{getattr(self.kernel, '__name__', 'kernel')}: a launch inside a CUDA graph capture "
                           f"with no compiled kernel bound for it")
        compiled = self.kernel[self.grid](*tensors, *self.args, **self.kw)
        if c is None:
            self.bind(compiled, tensors)

    def bind(self, compiled, tensors) -> None:
        """Keep ``compiled`` (what the JIT launch returned: a compiled kernel, or None under the
        interpreter) with the arguments a direct launch passes after the pointers: every parameter of
        the kernel in order, constexprs included, as triton's JIT passes them."""
        if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            return
        names = list(getattr(self.kernel, "arg_names", ()))
        given = {**dict(zip(names, (*tensors, *self.args), strict=False)), **self.kw}
        if len(names) < len(tensors) + len(self.args) or any(n not in given for n in names):
            return   # a parameter left to its default: not bound, the JIT keeps launching it
        try:
            if torch.cuda.is_current_stream_capturing():
                return   # bound at a launch outside the capture (the check below synchronizes)
        except (AssertionError, RuntimeError):
            pass
        dev = tensors[0].device
        if dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
            return   # the JIT compiled and loaded it for the current device, not the tensors': not bound
        if bound_launch_problem(dev) is not None:
            return
        import triton
        rt = getattr(getattr(triton, "knobs", None), "runtime", None)
        if rt is None:
            return   # a triton before 3.4 (no knobs): its launch hooks live elsewhere, the JIT keeps launching
        self.rt = rt
        self.tail = [given[n] for n in names[len(tensors):]]
        self.aligned = tuple(i for i, t in enumerate(tensors) if t.data_ptr() % 16 == 0)
        self.device = tensors[0].device.index if tensors[0].device.index is not None else 0
        self.compiled = compiled


#: the newest triton whose launcher's arguments were read (3.4-3.9 take the same call); a newer one
#: may read them differently, where a wrong argument count is an out-of-bounds read, not an error
LAUNCHER_READ = (3, 9)


def _unread_launcher() -> str | None:
    """Why this triton's compiled kernels are not launched directly without being read first."""
    import triton
    v = triton.__version__
    mm = tuple(int(p) if p.isdigit() else 0 for p in v.split("+")[0].split(".")[:2])
    if mm > LAUNCHER_READ:
        return (f"triton {v} is newer than the launchers the direct launch was built for "
                f"(up to {'.'.join(map(str, LAUNCHER_READ))}), so its kernels launch through its JIT")
    return None


def bound_launch_problem(device) -> str | None:
    """Why planned launches cannot launch their compiled kernel directly here (None: they can):
    checked once per process on ``device`` by launching a small kernel both ways and comparing
    (a triton whose launcher takes other arguments fails it); on failure every launch goes
    through the JIT (:data:`BIND`) and captures run the torch ops instead of the kernels. Another
    thread asking while the check runs (a device's pool thread) waits for its answer."""
    with _BIND_LOCK:   # reentrant: the check's own launches come back here and bind without checking again
        if not _BIND_CHECKED:
            _BIND_CHECKED.append(None)
            try:
                _BIND_CHECKED[0] = _unread_launcher()
                if _BIND_CHECKED[0] is None:
                    from . import _launch_check
                    _BIND_CHECKED[0] = _launch_check.run(device, Launch)
            except Exception as e:   # anything: the JIT stays the way kernels launch
                _BIND_CHECKED[0] = f"the direct launch check failed ({type(e).__name__}: {e})"
            if _BIND_CHECKED[0] is not None:
                BIND[0] = False
        return _BIND_CHECKED[0]


def tf32_matmuls_allowed() -> bool:
    """Whether torch itself would run an fp32 CUDA matmul in TF32. torch >= 2.9 has
    ``fp32_precision`` (it also reflects the legacy setters); reading the legacy
    ``allow_tf32`` there raises RuntimeError once anything used the new API."""
    matmul = torch.backends.cuda.matmul
    try:
        return matmul.fp32_precision == "tf32"
    except AttributeError:  # torch < 2.9: only the legacy flag
        pass
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:
        return False


def check_row_block(kernel_name: str, arg: str, block_rows: int, row_stride: int) -> None:
    """A last tile's masked rows reach ``block_rows`` rows past the end; their 32-bit
    offsets must stay within the margin MAX_NUMEL leaves."""
    if block_rows * abs(row_stride) > OFFSET_MARGIN:
        raise KernelUnsupported(f"{kernel_name}: `{arg}` has row stride {row_stride}; tiles of {block_rows} rows "
                                f"would pass the kernel's 32-bit offsets.")


def matmul_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision for fp32 operands: TF32 only where torch itself
    would use it for an fp32 matmul; half types ignore it."""
    if dtype == torch.float32 and tf32_matmuls_allowed():
        return "tf32"
    return "ieee"


def dot_upcast(kernel, dtype: torch.dtype) -> bool:
    """The triton interpreter's tl.dot multiplies bf16 operands as their raw
    uint16 bit patterns (triton 3.2-3.9 ``create_dot``); under the interpreter
    bf16 operands are widened to fp32 first, which is exact (bf16 x bf16 fits
    fp32) and matches the GPU's fp32-accumulated bf16 dot."""
    return dtype == torch.bfloat16 and is_interpreted(kernel)


def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill exactly numel() consecutive
    slots from data_ptr() (any dim order: contiguous, channels_last, ...)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


# (kernel name, shape-class key, device index) -> index of the first config that loaded
_CONFIG_CHOICE: dict = {}


def launch_first_fitting(kernel, key: tuple, configs: list[dict], grid_fn, args: tuple, kwargs: dict,
                         what: str, device: torch.device) -> tuple[int, object]:
    """Launch ``kernel`` with the first of ``configs`` (launch options and block
    constexprs, biggest first) whose compiled form fits this GPU's shared
    memory / registers; the choice is remembered per (key, device), so the
    OutOfResources probe happens once. ``grid_fn(config)`` gives the grid. Returns (the index of
    the config launched, what triton's JIT launch returned: the compiled kernel on a GPU)."""
    from triton.runtime.errors import OutOfResources

    ck = (getattr(kernel, "__name__", repr(kernel)), key, str(device))
    start = _CONFIG_CHOICE.get(ck, 0)
    last = None
    for i in range(start, len(configs)):
        cfg = configs[i]
        try:
            compiled = kernel[grid_fn(cfg)](*args, **kwargs, **cfg)
        except OutOfResources as e:
            last = e
            continue
        _CONFIG_CHOICE[ck] = i
        return i, compiled
    raise KernelUnsupported(f"{what}: no block configuration fits this GPU ({last}).")


def check_dot_dtype(kernel_name: str, dtype: torch.dtype, device: torch.device) -> None:
    """tl.dot on bf16 needs an Ampere-or-newer GPU (sm_80+)."""
    cap = gpu_capability(device)
    if dtype == torch.bfloat16 and cap is not None and cap < (8, 0):
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "the target"
        raise KernelUnsupported(f"{kernel_name}: bf16 matrix products need a compute capability 8.0+ GPU; "
                                f"{gpu} is {'.'.join(map(str, cap))}.")
