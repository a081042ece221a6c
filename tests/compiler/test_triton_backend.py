"""The triton backend's region bodies, wired into real UNets.

Without a GPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py)
and the backend's CUDA requirement is lifted for the test only; the bodies,
the live-weight reads and the fallbacks are what is checked here. With a GPU
the same tests run on CUDA for real."""
import pytest
import torch

pytest.importorskip("triton", reason="triton not installed: the triton backend tests skip")
pytest.importorskip("diffusers", reason="diffusers not installed")

from unet_compiler.compiler import compile_unet, report  # noqa: E402
from unet_compiler.compiler.api import accelerator_of  # noqa: E402
from unet_compiler.compiler.backends import _kernel_choice as KC  # noqa: E402
from unet_compiler.compiler.backends import triton as TB  # noqa: E402
from unet_compiler.compiler.config import CompileConfig  # noqa: E402
from unet_compiler.compiler.lifecycle.scheduler import Scheduler  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def triton_here(monkeypatch):
    if DEV.type == "cpu":
        monkeypatch.setattr(TB.TritonBackend, "available", lambda self, device: (True, "interpreter (test)"))
    monkeypatch.setenv(KC.CHOICE_ENV, "triton")  # on a GPU: the kernels, not whichever measured faster


def _attention_as_expected(bodies) -> bool:
    """fp32 models: the attention kernel runs under the interpreter; on CUDA it declines fp32
    (its tiles spill; SDPA runs it: kernels/attention.py) and the torch op runs in its place."""
    if DEV.type == "cuda":
        return bodies.fired["attention"] == 0 and bodies.declined["attention"] > 0
    return bodies.fired["attention"] > 0


def _unet(make, seed=0, **over):
    u = make(seed, **over).to(DEV)
    with torch.no_grad():
        for p in u.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return u


def _run(u, b=2, side=8, tokens=77, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 4, side, side, generator=g).to(DEV)
    c = torch.randn(b, tokens, 32, generator=g).to(DEV)
    with torch.inference_mode():
        return u(x, torch.full((b,), 500.0, device=DEV), c).sample


def test_diffusers_unet_parity_and_kernels_fired(tiny_unet, triton_here):
    u = _unet(tiny_unet)
    ref = _run(u)
    compile_unet(u, "triton")
    out = _run(u)
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)
    text = report(u)
    assert "backend triton" in text, text
    fired = accelerator_of(u).backend.ops.fired
    assert fired["groupnorm_silu"] > 0 and fired["geglu"] > 0 and _attention_as_expected(accelerator_of(u).backend.ops)
    assert fired["bias_residual"] > 0
    assert "triton kernels fired:" in text
    # where: GroupNorm+SiLU in ResBlocks (and the output norm), GEGLU in feed-forward regions
    assert "geglu x" in text and "(feedforward " in text and "groupnorm_silu x" in text and "resblock " in text, text
    if DEV.type == "cpu":
        assert "attention x" in text and "(attention " in text, text


def test_live_weights_and_irregular_tokens(tiny_unet, triton_here):
    u = _unet(tiny_unet)
    compile_unet(u, "triton")
    _run(u)
    with torch.no_grad():  # a LoRA merged after compiling: new Parameters
        for m in u.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.GroupNorm)):
                m.weight = torch.nn.Parameter(m.weight * 1.1, requires_grad=False)
    with accelerator_of(u).bypass():
        ref = _run(u, b=1, side=6, tokens=154)
    torch.testing.assert_close(_run(u, b=1, side=6, tokens=154), ref, rtol=2e-4, atol=2e-4)


def test_kernel_refusal_runs_the_models_own_code(tiny_unet, triton_here, monkeypatch):
    from unet_compiler.kernels import attention as attention_kernels
    from unet_compiler.kernels._common import KernelUnsupported

    def refuse(*a, **k):
        raise KernelUnsupported("attention: test refusal")
    monkeypatch.setattr(attention_kernels, "attention", refuse)
    monkeypatch.setattr(KC, "_CHOICE", {})     # the refusal is remembered per signature: this test's only
    monkeypatch.setattr(KC, "_DECLINED", {})
    u = _unet(tiny_unet)
    ref = _run(u)
    compile_unet(u, "triton")
    torch.testing.assert_close(_run(u), ref, rtol=2e-4, atol=2e-4)
    bodies = accelerator_of(u).backend.ops
    assert bodies.declined["attention"] > 0 and bodies.fired["attention"] == 0  # a refused launch is not "fired"
    # the refusal costs that piece only: SDPA ran on the q/k/v already projected, the region stayed accelerated
    assert accelerator_of(u).stats["ran_attention"] > 0 and bodies.fired["geglu"] > 0
    assert "triton kernels not used (the torch ops they replace, or the model's own code, ran): attention" in \
        report(u)


def test_comfy_unet_parity(triton_here, make_comfy_model):
    from unet_compiler.compiler.config import CompileConfig
    from unet_compiler.nodes import patcher, warmup as nodes_warmup
    import comfy.model_management as mm
    mp = make_comfy_model("sdxl", device=mm.get_torch_device())   # the GPU when there is one: triton needs CUDA
    assert mp.load_device.type == DEV.type
    g = torch.Generator().manual_seed(3)
    x, ctx, y = (t.to(DEV) for t in (torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 77, 64, generator=g),
                                     torch.randn(2, 96, generator=g)))

    def apply(m):
        mm.load_models_gpu([m])
        with torch.inference_mode():
            return m.model.apply_model(x, torch.full((2,), 2.0, device=DEV), c_crossattn=ctx, y=y,
                                       transformer_options=nodes_warmup.sampling_transformer_options(m))
    ref = apply(mp)
    cm, text = patcher.compile_model(mp, CompileConfig(backend="triton"))
    assert "backend triton" in text, text
    assert next(cm.model.diffusion_model.parameters()).device.type == DEV.type
    torch.testing.assert_close(apply(cm), ref, rtol=2e-4, atol=2e-4)
    bodies = patcher.accelerator_of(cm).backend.ops
    assert bodies.fired["groupnorm_silu"] > 0 and bodies.fired["geglu"] > 0 and _attention_as_expected(bodies)


def test_fp8_stored_comfy_unet_runs_the_kernels_on_comfys_cast(triton_here, make_comfy_model):
    """fp8 storage (ComfyUI casts each weight per call): the fused kernels read the cast weights
    (ComfyUI's cast, outside them) and every region ran them; compiled == eager."""
    from unet_compiler.compiler.config import CompileConfig
    from unet_compiler.nodes import patcher, warmup as nodes_warmup
    import comfy.model_management as mm
    mp = make_comfy_model("sd15", device=mm.get_torch_device(), weight_dtype=torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(3)
    x, ctx = (t.to(DEV) for t in (torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 77, 64, generator=g)))

    def apply(m):
        mm.load_models_gpu([m])
        with torch.inference_mode():
            return m.model.apply_model(x, torch.full((2,), 2.0, device=DEV), c_crossattn=ctx,
                                       transformer_options=nodes_warmup.sampling_transformer_options(m))
    ref = apply(mp)
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="triton"))
    torch.testing.assert_close(apply(cm), ref, rtol=2e-4, atol=2e-4)
    accel = patcher.accelerator_of(cm)
    bodies = accel.backend.ops
    assert bodies.fired["groupnorm_silu"] > 0 and bodies.fired["bias_residual"] > 0 and bodies.fired["geglu"] > 0
    assert accel.stats["region_eager"] == 0 and accel.stats["region_cast_compiled"] > 0, accel.text()
    assert all(p.dtype == torch.float8_e4m3fn for p in mp.model.diffusion_model.parameters())


def test_measured_choice_runs_torch_where_it_is_faster(tiny_unet, triton_here, monkeypatch):
    """The per-signature kernel-vs-torch choice, with timings handed in (on a GPU
    they come from CUDA events): torch wins GEGLU, the kernels win the rest;
    each signature is measured once and the report names what torch served."""
    monkeypatch.setattr(KC, "_measurable", lambda device: True)
    monkeypatch.setattr(KC, "_CHOICE", {})
    timed = []

    def fake_ms(fn, reps=5, timing="wall"):
        fn()   # a kernel that refuses its inputs raises here, as on a GPU, and is not measured
        timed.append(fn)
        name, is_kernel = fake_ms.current, fn is fake_ms.kernel
        return (2.0 if is_kernel else 1.0) if name == "geglu" else (1.0 if is_kernel else 2.0)
    fake_ms.current = fake_ms.kernel = None
    real_pick = KC.KernelChoice.pick

    def pick(self, name, tensors, kernel, reference):
        fake_ms.current, fake_ms.kernel = name, kernel
        return real_pick(self, name, tensors, kernel, reference)
    monkeypatch.setattr(KC, "_measure_ms", fake_ms)
    monkeypatch.setattr(KC.KernelChoice, "pick", pick)
    u = _unet(tiny_unet)
    ref = _run(u)
    compile_unet(u, "triton")
    torch.testing.assert_close(_run(u), ref, rtol=2e-4, atol=2e-4)
    n_measured = len(timed)
    torch.testing.assert_close(_run(u, seed=5), _ref_of(u, seed=5), rtol=2e-4, atol=2e-4)
    assert len(timed) == n_measured  # same signatures: measured once
    b = accelerator_of(u).backend.ops
    assert b.torch_faster["geglu"] > 0 and b.fired["geglu"] == 0
    assert b.fired["groupnorm_silu"] > 0 and b.fired["bias_residual"] > 0 and _attention_as_expected(b)
    assert "torch measured faster on this GPU, ran instead: geglu x" in report(u)


def _ref_of(u, seed):
    with accelerator_of(u).bypass():
        return _run(u, seed=seed)


def test_kernel_compiles_count_as_compiles(tiny_unet, triton_here):
    """Triton specialisations of the pack's kernels count in 'graphs compiled' and, after
    warmup, as recompiles (the interpreter compiles nothing, so the hook is driven as triton
    drives it on a GPU)."""
    from triton import knobs
    u = _unet(tiny_unet)
    compile_unet(u, "triton")
    accel = accelerator_of(u)
    hook = knobs.runtime.jit_post_compile_hook
    assert hook is not None and hook.__name__ == "unet_compiler_count_compiles"
    from unet_compiler.kernels import attention as attention_kernels

    class Info:  # triton's JitFunctionInfo
        module, name = attention_kernels._attn_fwd_kernel.fn.__module__, "_attn_fwd_kernel"
    accel.warmed = True
    with torch.inference_mode(), accel.active():
        hook(key="k", repr="r", fn=Info(), compile={}, is_manual_warmup=False, already_compiled=False)
        hook(key="k", repr="r", fn=type("Other", (), {"module": "torch._inductor.x"})(), compile={},
             is_manual_warmup=False, already_compiled=False)   # not ours: not counted
    assert accel.stats["recompiles_after_warmup"] == 1, accel.stats


def test_bf16_precision_returns_the_model_dtype(tiny_unet, triton_here):
    """precision bf16 runs the regions under autocast (the kernels get bf16 tensors);
    a diffusers caller still gets the model's fp32 back, within bf16 error of eager."""
    u = _unet(tiny_unet)
    ref = _run(u)
    compile_unet(u, "triton", precision="bf16")
    out = _run(u)
    assert out.dtype == torch.float32
    err = float((out - ref).abs().max())
    assert 0 < err < 0.1, err  # bf16 rounding, not a different model
    assert "precision bf16" in report(u) and accelerator_of(u).backend.ops.fired["attention"] > 0


def _variant_key(fn, args, kwargs) -> tuple:
    """The compiled-variant key Triton derives for a launch: constexprs by value, int
    arguments by class (== 1, divisible by 16, other) unless do_not_specialize, tensors
    by dtype and 16-byte alignment, launch options by value."""
    import inspect
    import triton.language as tl
    sig = inspect.signature(fn.fn)
    skip = set(fn.kwargs.get("do_not_specialize") or ())
    bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters}).arguments
    key = [fn.fn.__name__]
    for name, p in sig.parameters.items():
        v = bound.get(name)
        if p.annotation is tl.constexpr or "constexpr" in str(p.annotation):
            key.append((name, v))
        elif isinstance(v, bool) or name in skip:
            key.append((name, v if isinstance(v, bool) else "-"))
        elif isinstance(v, int):
            key.append((name, "1" if v == 1 else "16" if v % 16 == 0 else "n"))
        elif isinstance(v, torch.Tensor):
            key.append((name, str(v.dtype), v.data_ptr() % 16 == 0))
    key.append(tuple(sorted((k, v) for k, v in kwargs.items() if k not in sig.parameters)))
    return tuple(key)


@pytest.mark.long   # a warmup of a range under the Triton interpreter: minutes (the GPU check runs it)
def test_new_resolutions_inside_the_warmed_box_compile_no_kernel_variants(tiny_unet, triton_here, monkeypatch):
    """Dynamic shapes on the triton backend: after Warmup Shapes, batch and resolution
    changes inside the box must not compile new Triton kernel variants. On a GPU the
    compile hook counts real compiles; under the interpreter every launch's variant key
    (Triton's specialisation rules) is recorded and must already have been seen."""
    keys: set = set()
    if DEV.type == "cpu":
        import triton.runtime.interpreter as TI
        real_run = TI.InterpretedFunction.run

        def run(self, *args, grid, warmup, **kwargs):
            keys.add(_variant_key(self, args, kwargs))
            return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        monkeypatch.setattr(TI.InterpretedFunction, "run", run)
    from unet_compiler.compiler import warmup
    u = _unet(tiny_unet)
    compile_unet(u, "triton")
    text = warmup(u, "1x64x64, 2x96x96", context_tokens=77, compare=False)
    assert "80x80 (probe)" in text, text  # (the all-multiple-of-16 probe is 64 px for this 2-level UNet)
    warmed = set(keys)
    accel = accelerator_of(u)
    assert warmed or DEV.type != "cpu"   # (recorded under the interpreter only)
    for b, side_w, side_h in [(2, 72, 88), (1, 96, 64)]:
        g = torch.Generator().manual_seed(b + side_w)
        x = torch.randn(b, 4, side_h // 8, side_w // 8, generator=g).to(DEV)
        with torch.inference_mode():
            u(x, torch.full((b,), 10.0, device=DEV), torch.randn(b, 77, 32, generator=g).to(DEV))
        new = keys - warmed
        assert not new, f"{b}x{side_w}x{side_h} compiled new kernel variants: {sorted(new, key=str)[:3]}"
    assert accel.stats["recompiles_after_warmup"] == 0, accel.text()


def _record_variants(monkeypatch) -> set:
    import triton.runtime.interpreter as TI
    keys: set = set()
    real_run = TI.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        keys.add(_variant_key(self, args, kwargs))
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)
    monkeypatch.setattr(TI.InterpretedFunction, "run", run)
    return keys


@pytest.mark.skipif(DEV.type != "cpu", reason="variant keys are recorded from the interpreter (GPU: the compile "
                                              "counter test above)")
def test_kernel_variants_do_not_depend_on_spatial_or_token_sizes(monkeypatch):
    """Block sizes come from channels / head dim / layout only, and size arguments that
    only bound loops are not specialised: across SD-like spatial sizes and prompt
    lengths each kernel compiles one variant per class of its spatial size (a multiple
    of 16 or not), however many sizes there are."""
    from unet_compiler.kernels import attention, epilogue, geglu, groupnorm
    keys = _record_variants(monkeypatch)
    # sides whose square is a multiple of 16 (4, 8, 12, 16, 20) and not (3, 5, 9, 10, 11, 18)
    for s in (4, 8, 12, 16, 20, 3, 5, 9, 10, 11, 18):
        x = torch.randn(2, 32, s, s)
        groupnorm.groupnorm(x, 8, torch.ones(32), torch.zeros(32), 1e-5, silu=True)
        groupnorm.groupnorm(x.to(memory_format=torch.channels_last), 8, None, None, 1e-5)
        epilogue.bias_residual(x, torch.randn(32), torch.randn_like(x), dim=1)
        geglu.geglu(torch.randn(2, s * s, 64))
        for nk in (s * s, 77, 154):  # self-attention and 1-2 prompt chunks, laid out as the UNet's views
            q, k, v = (torch.randn(2, n, 4, 8).transpose(1, 2) for n in (s * s, nk, nk))
            attention.attention(q, k, v)
    per_kernel: dict = {}
    for k in keys:
        per_kernel.setdefault(k[0], set()).add(k)
    # groupnorm: stats + apply kernels, NCHW and channels_last, affine or not: one variant per class each
    assert len(per_kernel["_attn_fwd_kernel"]) == 1, sorted(per_kernel["_attn_fwd_kernel"], key=str)
    assert len(per_kernel["_geglu_kernel"]) == 1, sorted(per_kernel["_geglu_kernel"], key=str)
    assert len(per_kernel["_bias_residual_kernel"]) == 1, sorted(per_kernel["_bias_residual_kernel"], key=str)
    assert len(per_kernel["_gn_apply_kernel"]) <= 2 * 2 * 2, sorted(per_kernel["_gn_apply_kernel"], key=str)
    assert len(per_kernel["_gn_stats_kernel"]) <= 2 * 2, sorted(per_kernel["_gn_stats_kernel"], key=str)


def test_conv_residual_checks_dtype_and_layout_before_the_conv(monkeypatch):
    """Under fp16/bf16 precision an fp32 model's conv gives bf16 while the skip stays fp32: the
    bias+residual pass cannot take them. That is decided before the conv runs (the conv runs
    once, nothing is measured or re-run), and the call gives conv(h) + skip."""
    bodies = TB.TritonOps()
    conv = torch.nn.Conv2d(8, 8, 3, padding=1).to(DEV)
    h, skip = torch.randn(2, 8, 6, 6, device=DEV), torch.randn(2, 8, 6, 6, device=DEV)
    calls = []
    real_conv2d = torch.nn.functional.conv2d
    monkeypatch.setattr(torch.nn.functional, "conv2d", lambda *a, **k: calls.append(1) or real_conv2d(*a, **k))
    monkeypatch.setattr(bodies, "pick", lambda *a, **k: pytest.fail("no kernel-vs-torch choice for a mismatch"))
    with torch.inference_mode(), torch.autocast(DEV.type, dtype=torch.bfloat16):
        out = bodies.conv_residual(conv, h, skip)
        ref = conv(h) + skip
    assert len(calls) == 2   # one conv for the body, one for the reference: no wasted conv
    torch.testing.assert_close(out, ref)
    assert bodies.declined["bias_residual (conv output bfloat16, skip float32)"] == 1, bodies.declined
    assert TB._epilogue_mismatch(h, skip.to(memory_format=torch.channels_last)) == "skip in another memory layout"
    assert TB._epilogue_mismatch(h, skip) is None


def test_a_declined_signature_is_remembered(monkeypatch):
    """A kernel that refuses a signature (fp32 attention on CUDA) is not tried again on every call:
    the torch ops serve that signature from then on, and the declines are still counted."""
    monkeypatch.setattr(KC, "_CHOICE", {})
    monkeypatch.setattr(KC, "_DECLINED", {})
    ops = KC.KernelChoice()
    tries = []

    def kernel():
        tries.append(1)
        raise ops.Unsupported("attention: fp32 on CUDA is left to SDPA")
    x = torch.zeros(2, 3)
    for _ in range(3):
        assert ops.pick("attention", [x], kernel, lambda: "torch") == "torch"
    assert len(tries) == 1 and ops.declined["attention"] == 3 and ops.fired["attention"] == 0
    assert ops.pick("attention", [torch.zeros(4, 3)], kernel, lambda: "torch") == "torch" and len(tries) == 2, \
        "another signature is tried"


class _FakeGPU:
    """One stream, in ms: a call costs host time to launch and device time to run, queued behind the
    work before it; a sync waits for the queue; an event records where the queue is."""

    def __init__(self):
        self.host = self.dev = 0.0

    def call(self, host_ms, dev_ms):
        self.host += host_ms
        self.dev = max(self.dev, self.host) + dev_ms

    def sync(self, *a):
        self.host = max(self.host, self.dev)

    def event(self, enable_timing=True):
        gpu = self

        class Event:
            def record(self):
                self.t = max(gpu.dev, gpu.host)

            def elapsed_time(self, end):
                return end.t - self.t
        return Event()

    def sleep(self, cycles):
        self.dev = max(self.dev, self.host) + 100.0


def test_the_choice_times_what_the_user_pays(monkeypatch):
    """A launch-bound kernel (3 launches and their checks: 3 ms of host time, 0.5 ms on the device)
    against the torch ops it replaces (0.5 ms host, 1 ms device): without graphs the step pays the
    host time, so torch serves the signature; under CUDA graphs a replay pays device time only, so
    the kernel does. (Before, device time alone was timed, and the kernel won both: the step got
    slower at launch-bound sizes.)"""
    import types
    gpu = _FakeGPU()
    monkeypatch.setattr(torch.cuda, "synchronize", gpu.sync)
    monkeypatch.setattr(torch.cuda, "Event", gpu.event)
    monkeypatch.setattr(torch.cuda, "_sleep", gpu.sleep, raising=False)
    monkeypatch.setattr(KC, "time", types.SimpleNamespace(perf_counter=lambda: gpu.host / 1000))
    monkeypatch.setattr(KC, "_measurable", lambda device: True)
    monkeypatch.setattr(KC, "_CHOICE", {})
    kernel = lambda: gpu.call(3.0, 0.5) or "kernel"     # noqa: E731
    torch_ops = lambda: gpu.call(0.5, 1.0) or "torch"   # noqa: E731
    assert KC._measure_ms(kernel, timing="wall") == pytest.approx(3.0, rel=0.05)
    assert KC._measure_ms(torch_ops, timing="wall") == pytest.approx(1.0, rel=0.2)
    assert KC._measure_ms(kernel, timing="device") == pytest.approx(0.5)
    assert KC._measure_ms(torch_ops, timing="device") == pytest.approx(1.0)
    x = torch.zeros(2, 320, 64, 64)
    no_graphs, graphs = KC.KernelChoice("wall"), KC.KernelChoice("device")
    assert no_graphs.pick("groupnorm_silu", (x,), kernel, torch_ops) == "torch"
    assert graphs.pick("groupnorm_silu", (x,), kernel, torch_ops) == "kernel"
    assert no_graphs.torch_faster["groupnorm_silu"] == 1 and graphs.fired["groupnorm_silu"] == 1
    runs = gpu.host
    assert no_graphs.pick("groupnorm_silu", (x,), kernel, torch_ops) == "torch" and gpu.host - runs == 0.5, \
        "measured once per signature and timing"
    assert 2 * (1 + KC.REPS) == 12   # timed runs per signature (22 before)


def test_the_backend_times_for_its_graphs(triton_here):
    """Device time where the runtime says graphs replay (asked for is not enough: they can be
    refused), wall time otherwise and once they stop (tests/compiler/test_cuda_graphs.py wires it)."""
    from unet_compiler.compiler.backends import lookup_backend
    b = lookup_backend("triton")()
    b.impls(CompileConfig(backend="triton"), Scheduler())
    assert b.ops.timing == "wall"
    b.impls(CompileConfig(backend="triton", cuda_graphs=True), Scheduler())
    assert b.ops.timing == "wall"
    b.graphs_replay = True
    b.impls(CompileConfig(backend="triton", cuda_graphs=True), Scheduler())
    assert b.ops.timing == "device"
    b.graphs_stopped()
    assert b.ops.timing == "wall" and not b.graphs_replay


def test_streamed_weights_run_the_kernels_op_by_op(triton_here, make_comfy_model, dynamic_vram):
    """Dynamic VRAM with no VBAR room, every op slotted (the double: each weight through an offload
    stream's shared cast buffer, which the next cast on that stream overwrites): the triton backend
    runs every region op by op, each conv and linear casting its own weight where it runs and the
    groupnorm kernel reading its norm's cast, released once it is queued; compiled == eager, no
    weight copied, every region compiled, no pin left. (Before: every weight of a region was cast
    up front and the shared buffers' views copied.)"""
    from unet_compiler.compiler.config import CompileConfig
    from unet_compiler.nodes import patcher, warmup as nodes_warmup
    import comfy.model_management as mm
    dyn = dynamic_vram.patcher(make_comfy_model("sd15"), budget=0.0, small=0)
    g = torch.Generator().manual_seed(3)
    x, ctx = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 77, 64, generator=g)

    def apply(m):
        mm.load_models_gpu([m])
        with torch.inference_mode():
            return m.model.apply_model(x, torch.full((2,), 2.0), c_crossattn=ctx,
                                       transformer_options=nodes_warmup.sampling_transformer_options(m))
    ref = apply(dyn)
    cm, _ = patcher.compile_model(dyn, CompileConfig(backend="triton"))
    shared = dynamic_vram.shared_casts
    torch.testing.assert_close(apply(cm), ref, rtol=2e-4, atol=2e-4)
    accel = patcher.accelerator_of(cm)
    n = sum(accel.report.regions.values())
    assert accel.stats["region_streamed"] == n and accel.stats["region_eager"] == 0, accel.text()
    assert accel.backend.ops.fired["groupnorm_silu"] > 0 and accel.stats["cast_views_copied"] == 0
    assert dynamic_vram.shared_casts > shared and dyn.vbar().pinned() == 0
    assert f"{n} op by op, their weights streamed" in accel.text()
