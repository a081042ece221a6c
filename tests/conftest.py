"""Shared fixtures. ComfyUI is found via COMFYUI_PATH, else ~/comfy/ComfyUI;
without it, or without its requirements in this env, the ComfyUI tests skip with one line."""
from __future__ import annotations

import os
import sys

import pytest
import torch

# Triton kernels run on CPU tensors under the interpreter; it must be chosen
# before triton is first imported (inductor may import it during collection).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # fp32 parity is IEEE fp32 on a GPU too: torch's default runs cuDNN convs in TF32, which rounds
    # inputs to 10 mantissa bits and turns 1e-7 differences upstream into 1e-3 (an H100 showed it)
    torch.backends.cudnn.allow_tf32 = False   # (the legacy setter keeps conv and RNN flags alike: both APIs read it)

# the pack's persistent compile cache is off in tests (tests/compiler/test_cache.py turns it on for itself):
# a test counts the graphs it compiles, and the cache would also move torch's inductor cache out of
# /tmp. Where one is turned on, it writes to a fresh folder per session, never ~/.cache.
os.environ.setdefault("UNET_COMPILER_CACHE", "off")
# (a pytest-xdist worker inherits the folder its controller made: each worker makes its own)
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if "UNET_COMPILER_CACHE_DIR" not in os.environ or (_WORKER and os.environ.get("UNET_COMPILER_TEST_CACHE_DIR_MADE")):
    import tempfile
    os.environ["UNET_COMPILER_CACHE_DIR"] = tempfile.mkdtemp(prefix="unet_compiler_test_cache_")
    os.environ["UNET_COMPILER_TEST_CACHE_DIR_MADE"] = "1"
# pytest-xdist's workers share the cores: torch's threads are shared out among them (two workers
# with two OpenMP threads each on two cores spent 60% more CPU time on the same tests, in spin waits)
if _WORKER:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

from unet_compiler.tests._families import comfy_path, comfy_problem  # noqa: E402 - after TRITON_INTERPRET is chosen


def pytest_configure(config):
    """Refuse to run with the checkout on ``sys.path``: its ``kernels/`` would hide Hugging Face's
    ``kernels`` and diffusers' UNet would not import (tests/_pack.py)."""
    from unet_compiler.tests._pack import shadow_problem
    problem = shadow_problem()
    if problem:
        raise pytest.UsageError(problem)
    os.environ["PYTHONSAFEPATH"] = "1"   # nor the tests' children (``python -c`` / ``-m`` in the checkout)


#: set to 1 to run the tests marked ``long`` too (CI runs without them, to stay within its time)
LONG_ENV = "UNET_COMPILER_LONG_TESTS"


@pytest.hookimpl(tryfirst=True)   # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    from unet_compiler.tests._lanes import LONG, lane
    for item in items:
        if lane(item.nodeid) == "full":
            item.add_marker(pytest.mark.full)
        if item.nodeid in LONG:
            item.add_marker(pytest.mark.long)
    if os.environ.get(LONG_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"long: set {LONG_ENV}=1 to run it (CI's set leaves it out for time)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def comfy():
    """Import ComfyUI in-process on CPU; returns a namespace of its modules. Skips with one line
    without a ComfyUI tree, or when its requirements are not installed in this env (naming the command)."""
    problem = comfy_problem()
    if problem:
        pytest.skip(problem)
    path = comfy_path()
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    from comfy.cli_args import args
    args.cpu = not torch.cuda.is_available()   # ComfyUI's own device choice: the GPU when there is one
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models
    import comfy.patcher_extension
    import comfy.ops
    import comfy.lora
    import comfy.utils
    import comfy.ldm.modules.attention as attention
    ns = type("Comfy", (), {})()
    ns.path = path
    ns.mm, ns.mp, ns.sm = comfy.model_management, comfy.model_patcher, comfy.supported_models
    ns.ext, ns.ops, ns.lora, ns.utils, ns.attention = (comfy.patcher_extension, comfy.ops, comfy.lora,
                                                        comfy.utils, attention)
    return ns


@pytest.fixture(autouse=True)
def _no_cpu_isa_record_between_tests():
    """compiler/cache/cpu_isa.py's routing of inductor's ISA probe is per process: each test starts without it."""
    yield
    from unet_compiler.tests import _cpu_isa
    _cpu_isa.uninstall()


@pytest.fixture
def make_comfy_model(comfy):
    """Build a random-weight tiny SD1.5/SDXL-shaped BaseModel from ComfyUI's own classes,
    wrapped in a real ModelPatcher (``patch_compat.build_tiny``: its ``TINY`` configs)."""
    from unet_compiler.tests._patch_compat import build_tiny

    def make(kind="sd15", seed=0, device="cpu", weight_dtype=None):
        """``device``: where ComfyUI loads the model ("cpu", or ComfyUI's own choice with
        ``comfy.mm.get_torch_device()``: the GPU on a GPU machine); it is offloaded to the CPU.
        ``weight_dtype``: a storage dtype ComfyUI casts to fp32 on every call."""
        return build_tiny(kind, seed, device, weight_dtype)
    return make


class GraphStandIn:
    """CUDA-graph buffer semantics on any device, for compiler.graphs.RegionGraphs:
    a capture records without producing a result (its output is NaN until a
    replay); a replay recomputes from the static inputs into the static output."""

    def __init__(self, fail=None):
        self.captures = 0
        self.fail = fail

    def usable(self, tensors):
        return None

    def first_call(self, fn, device):
        return fn()

    def capture(self, fn, device):
        if self.fail:
            raise RuntimeError(self.fail)
        out = fn()
        def tensors(o):   # one tensor, or a DiT block's tuple (SD3's last block: (None, x))
            return [t for t in ((o,) if isinstance(o, torch.Tensor) else o) if t is not None]
        for o in tensors(out):
            o.fill_(float("nan"))  # a capture records work; it does not run it
        self.captures += 1

        class Graph:
            def replay(self):
                for o, n in zip(tensors(out), tensors(fn()), strict=True):
                    o.copy_(n)
        return Graph(), out


class StrictGraphStandIn(GraphStandIn):
    """CUDA-graph semantics closer to the real thing than :class:`GraphStandIn`: the capture runs the
    body once recording every aten op, refusing what a capture cannot hold (``.item()`` / ``bool()``
    of a tensor, random ops: ``tests/_fake_cuda.CaptureError``); a replay re-runs the recorded ops on
    the captured tensors, not the body's Python, so Python state the body read at capture stays
    frozen, as in a CUDA graph (``tests/_fake_cuda.py`` fakes torch.cuda around the production
    CudaGraphs the same way)."""

    def capture(self, fn, device):
        from unet_compiler.tests._fake_cuda import record, replay
        if self.fail:
            raise RuntimeError(self.fail)
        ops: list = []
        out = record(fn, ops)
        self.captures += 1
        self.recorded = ops   # the last capture's ops (for a test that looks inside)
        for o in [t for t in ((out,) if isinstance(out, torch.Tensor) else out) if isinstance(t, torch.Tensor)]:
            o.fill_(float("nan"))  # a capture records work; it does not run it

        class Graph:
            def replay(self):
                replay(ops)
        return Graph(), out


@pytest.fixture
def graph_standin():
    return GraphStandIn


@pytest.fixture
def strict_graph_standin():
    return StrictGraphStandIn


#: the tiny SD1.5-shaped diffusers UNet every diffusers test builds (``tiny_unet``)
TINY_UNET = dict(sample_size=8, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=8, norm_num_groups=8)


@pytest.fixture
def tiny_unet():
    """Factory of a random-weight tiny SD-shaped diffusers UNet (2 levels, cross-attention
    on a 32-wide context), eval mode, on CPU: ``tiny_unet(seed, **config overrides)``.
    ``tiny_unet.config(**overrides)`` is its config, for a test that builds it in a subprocess."""
    diffusers = pytest.importorskip("diffusers", reason="diffusers not installed")

    def config(**over):
        return {**TINY_UNET, **over}

    def make(seed=0, **over):
        torch.manual_seed(seed)
        return diffusers.UNet2DConditionModel(**config(**over)).eval()
    make.config = config
    return make


@pytest.fixture
def dynamic_vram(comfy):
    """The newest ComfyUI's Dynamic VRAM over this ComfyUI (``tests/_dynamic_vram.py``): installed for
    the test; ``dynamic_vram.patcher(mp, budget, small, reload)`` makes a dynamic patcher over ``mp``'s
    model (``reload()``: the checkpoint loaded again, for ``clone(disable_dynamic=True)``)."""
    pytest.importorskip("comfy_aimdo.model_vbar", reason="comfy-aimdo not installed (bin/setup installs it)")
    from unet_compiler.tests._dynamic_vram import DynamicVRAM, make_dynamic
    double = DynamicVRAM(comfy.ops)
    double.patcher = lambda mp, budget=0.5, small=256, reload=None, stored=None: make_dynamic(comfy, mp, budget, small,
                                                                                          reload, stored)
    with double.installed():
        yield double
    comfy.mm.unload_all_models()
