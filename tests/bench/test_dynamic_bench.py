"""``bench dynamic`` (bench/dynamic.py) on a machine without a GPU: the double's comfy-aimdo VBAR for
a CUDA load device (tests/_dynamic_vram.CudaVBAR) driven through comfy-aimdo's real Python API
(``control``'s device set-up, ``model_vbar``'s bindings, ``ModelVBAR``, ``vbar_fault`` / ``vbar_unpin``)
over a stand-in of its native library that ``control.init`` loads, so the GPU call's wiring is
checked here; the rows themselves run in CI's side lane (the tiny UNet) and on a GPU in the GPU check."""
from __future__ import annotations

import ctypes

import pytest
import torch

BASE = 1 << 40      # the stand-in VBAR's base address


class _Native:
    """One function of the stand-in native library: callable, and takes the ``argtypes`` /
    ``restype`` comfy-aimdo's bindings set on a CDLL function (kept: bound or not)."""

    def __init__(self, fn):
        self.fn, self.argtypes, self.restype = fn, None, None

    def __call__(self, *args):
        return self.fn(*args)


class _AimdoLib:
    """comfy-aimdo 0.6.0's native library as ``control.init`` loads it and ``control`` / ``model_vbar``
    bind and call it: device contexts by integer index, one VBAR at ``BASE`` over CPU memory whose
    faults ending above the watermark limit fail (VBAR_FAULT_OOM), pins counted per range (an unpin
    of an unpinned range fails), a signature per residency. ``calls`` records what changes state."""

    def __init__(self):
        self.calls, self.pins, self.resident = [], {}, {}
        self.limit, self.memory, self._gen = 0, None, 0
        for name in ("set_log_callback", "get_total_vram_usage", "aimdo_analyze", "set_simple_vram_headroom",
                     "get_simple_vram_headroom", "set_nvml_pressure", "malloc_graph_create", "malloc_graph_push",
                     "malloc_graph_pause", "malloc_graph_set_stream", "malloc_graph_pop", "malloc_graph_abort",
                     "malloc_graph_stat", "malloc_graph_destroy", "vbar_set_watermark", "vbars_reset_watermark_limits",
                     "vbar_deprioritize", "vbar_free", "vbar_get_nr_pages", "vbar_get_watermark", "vbar_get_residency"):
            setattr(self, name, _Native(lambda *a: 0))
        for name in ("plat_init", "init", "get_devctx", "vbar_allocate", "vbar_get", "vbar_prioritize",
                     "vbar_set_watermark_limit", "vbar_fault", "vbar_unpin", "vbar_loaded_size", "vbar_free_memory",
                     "vbars_analyze"):
            setattr(self, name, _Native(getattr(self, "_" + name)))

    def _plat_init(self):
        return True

    def _init(self, devices, headrooms, n):
        self.calls.append(("init", list(devices)[:n]))
        return True

    def _get_devctx(self, device_id):
        assert type(device_id) is int, device_id      # (ctypes.c_int would refuse anything else)
        return 7

    def _vbar_allocate(self, devctx, size, device, callback):
        assert devctx == 7 and type(device) is int
        self.calls.append(("allocate", size, device))
        self.memory = torch.zeros(size, dtype=torch.uint8)
        return 99

    def _vbar_get(self, devctx, ptr):
        return BASE

    def _vbar_prioritize(self, devctx, ptr, clamp):
        self.calls.append(("prioritize", clamp))

    def _vbar_set_watermark_limit(self, devctx, ptr, size):
        self.calls.append(("watermark", size))
        self.limit = size

    def _vbar_fault(self, devctx, ptr, offset, size, signature):
        self.calls.append(("fault", offset, size))
        if offset + size > self.limit:
            return 1
        if offset not in self.resident:
            self._gen += 1
            self.resident[offset] = (size, self._gen)
        self.pins[offset] = self.pins.get(offset, 0) + 1
        signature[0] = self.resident[offset][1]
        return 0

    def _vbar_unpin(self, devctx, ptr, offset, size):
        self.calls.append(("unpin", offset, size))
        if not self.pins.get(offset):
            return False
        self.pins[offset] -= 1
        return True

    def _vbar_loaded_size(self, devctx, ptr):
        return sum(size for size, _ in self.resident.values())

    def _vbar_free_memory(self, devctx, ptr, size):
        self.calls.append(("free", size))
        freed = 0
        for offset in sorted(self.resident, reverse=True):
            if freed >= size:
                break
            if not self.pins.get(offset):
                freed += self.resident.pop(offset)[0]
        return freed

    def _vbars_analyze(self, devctx, verbose):
        assert devctx == 7
        return sum(size for offset, (size, _) in self.resident.items() if not self.pins.get(offset))


@pytest.fixture
def aimdo_native(monkeypatch):
    """A GPU machine's comfy-aimdo before ComfyUI's start-up, on this CPU: ``control`` not initialised
    and ``model_vbar`` imported already (its ``lib`` None, its bindings skipped), ``control.init``
    loading :class:`_AimdoLib`; ``aimdo_to_tensor`` (a CUDA array interface) hands out its memory."""
    pytest.importorskip("comfy_aimdo.model_vbar", reason="comfy-aimdo not installed (bin/setup installs it)")
    import comfy_aimdo.control as control
    import comfy_aimdo.model_vbar as model_vbar
    import comfy_aimdo.torch as aimdo_torch
    lib = _AimdoLib()
    monkeypatch.setattr(control, "lib", None)
    monkeypatch.setattr(control, "devctxs", [])
    monkeypatch.setattr(model_vbar, "lib", None)

    def init(*args, **kwargs):
        control.lib = lib
        return True
    monkeypatch.setattr(control, "init", init)
    lib.seen = []

    def to_tensor(alloc, device):
        vbar, address, size = alloc
        lib.seen.append((type(vbar).__name__, address - BASE, size, device))
        return lib.memory[address - BASE:address - BASE + size]
    monkeypatch.setattr(aimdo_torch, "aimdo_to_tensor", to_tensor)
    yield lib
    # (control.lib, devctxs and model_vbar.lib go back to None; model_vbar's bindings stay on the stand-in)


def test_the_gpu_vbar_goes_through_comfy_aimdos_own_api(aimdo_native):
    import comfy_aimdo.model_vbar as aimdo

    from unet_compiler.tests._dynamic_vram import CudaVBAR
    lib = aimdo_native
    v = CudaVBAR(1 << 20, 2000, torch.device("cuda", 0))
    assert aimdo.lib is lib and lib.vbar_fault.argtypes is not None      # bound when the library loaded
    a, b = v.alloc(300), v.alloc(700)
    assert a[0] is v and a[1] == BASE and b[1] == BASE + 512 and b[2] == 700     # aimdo's 512-byte alignment
    sig = aimdo.vbar_fault(b)
    assert isinstance(sig, ctypes.Array) and aimdo.vbar_signature_compare(sig, sig)
    aimdo.vbar_unpin(b)
    v.prioritize()
    v.set_budget(600)
    assert aimdo.vbar_fault(b) is None        # above the watermark: VBAR_FAULT_OOM, the op streams
    assert v.free_memory(1e32) == 700 and v.loaded_size() == 0
    assert v.tensor(b).numel() == 700 and lib.seen == [("ModelVBAR", 512, 700, torch.device("cuda", 0))]
    assert lib.calls == [("init", [0]), ("allocate", 1 << 20, 0), ("watermark", 2000), ("fault", 512, 700),
                         ("unpin", 512, 700), ("prioritize", 2**64 - 1), ("watermark", 600), ("fault", 512, 700),
                         ("free", 2**62)]


def test_the_gpu_rows_vbar_loads_streams_and_counts_through_aimdo(comfy, aimdo_native):
    """``bench dynamic``'s GPU path on its tiny UNet with only comfy-aimdo's native library stood in:
    the VBAR binds though ``model_vbar`` was imported first, a load prioritizes it, the patcher's
    free memory asks aimdo by device index, ops whose faults end above the watermark stream through
    a cast buffer on the op's device; the output == the plain model's, no pin left."""
    import comfy.model_management as mm

    from unet_compiler.bench.dynamic import build
    from unet_compiler.nodes import warmup as nodes_warmup
    from unet_compiler.tests import _families as F  # noqa: N812
    from unet_compiler.tests._dynamic_vram import CudaVBAR, DynamicVRAM, make_dynamic
    lib, dev = aimdo_native, torch.device("cpu")
    plain, fam = build("tiny", torch.float32, dev)
    x, sigma, kw = F.make_inputs(fam, plain, 1, 8, 8)

    def apply(mp):
        with torch.inference_mode():
            return mp.model.apply_model(x, sigma, transformer_options=nodes_warmup.sampling_transformer_options(mp), **kw)
    mm.load_models_gpu([plain])
    ref = apply(plain).clone()
    mm.unload_all_models()
    double = DynamicVRAM(comfy.ops)
    with double.installed():
        dyn = make_dynamic(comfy, build("tiny", torch.float32, dev)[0], budget=0.5, small=256)
        # the VBAR a CUDA load device gets (DynamicPatcher.vbar), for this CPU's load device
        dyn.model.dynamic_vbars = {str(dyn.load_device): CudaVBAR(2 * dyn.model_size() + (1 << 20), 0,
                                                                  torch.device("cuda", 0))}
        try:
            mm.load_models_gpu([dyn])
            assert ("prioritize", 2**64 - 1) in lib.calls
            torch.testing.assert_close(apply(dyn), ref, rtol=0, atol=0)
            assert lib.resident and double.shared_casts > 0, "both paths must run: resident and streamed"
            assert not any(lib.pins.values())
            assert dyn.get_free_memory(dyn.load_device) >= mm.get_free_memory(dyn.load_device)
            streamed = next(m for m in dyn.model.modules() if "_v" in m.__dict__ and m._v[1] - BASE + m._v[2] > lib.limit)
            double.cast_modules([streamed], torch.device("meta"))       # an op on another device than the CPU
            assert streamed._prefetch["signature"] is None and streamed._prefetch["dest"].device.type == "meta"
            del streamed._prefetch
        finally:
            mm.unload_all_models()


def test_the_rows_import_without_pyav(tmp_path):
    """The GPU check's first step (``bench dynamic --imports-only``) where PyAV is missing, as it may be
    on a GPU image: ComfyUI's TorchCompileModel module imports ``comfy_api.latest``, which needs ``av``;
    the rows reach torch.compile through ``comfy_api.torch_helpers`` and import without it."""
    import os
    import subprocess
    import sys

    from unet_compiler.tests._families import comfy_path
    if comfy_path() is None:
        pytest.skip("no ComfyUI tree (COMFYUI_PATH or ~/comfy/ComfyUI)")
    (tmp_path / "av").mkdir()
    (tmp_path / "av" / "__init__.py").write_text("raise ImportError(\"No module named 'av' (hidden by the test)\")\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-m", "unet_compiler.bench", "dynamic", "--imports-only", "--device", "cpu"],
                       env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0 and "bench dynamic: imports ok" in p.stdout, p.stdout + p.stderr[-2000:]


def test_torchcompilemodel_as_its_node_runs(comfy, monkeypatch):
    """The rows' TorchCompileModel == what the node's ``execute`` makes: the same wrapper on a clone,
    torch.compile called with the same arguments and the node's guard filter."""
    from comfy.patcher_extension import WrappersMP

    from unet_compiler.bench.dynamic import build, torch_compile_model
    asked = []

    def compile_(model=None, **kwargs):
        asked.append({**kwargs, "options": dict(kwargs["options"])})
        return model
    monkeypatch.setattr(torch, "compile", compile_)
    plain, _ = build("tiny", torch.float32, torch.device("cpu"))
    mine = torch_compile_model(plain)
    assert mine is not plain and not plain.model_options.get("torch_compile_kwargs")
    assert list(mine.wrappers[WrappersMP.APPLY_MODEL]) == ["torch.compile"]
    guard = asked[0]["options"]["guard_filter_fn"]
    entry = type("Entry", (), {})
    assert guard([type("E", (entry,), {"name": "L['transformer_options']['x']"}), type("E", (entry,), {"name": "L['x']"})]) \
        == [False, True]
    try:
        from comfy_extras.nodes_torch_compile import TorchCompileModel
    except ImportError:           # (no PyAV here: the node itself cannot be imported to compare)
        return
    theirs = TorchCompileModel.execute(plain, "inductor").result[0]
    assert {k: v for k, v in asked[1].items() if k != "options"} == {k: v for k, v in asked[0].items() if k != "options"}
    assert list(asked[1]["options"]) == ["guard_filter_fn"] == list(asked[0]["options"])
    assert list(theirs.wrappers[WrappersMP.APPLY_MODEL]) == ["torch.compile"]


def test_each_row_is_printed_as_measured_and_a_failure_skips_only_its_part(comfy, monkeypatch, capsys):
    """``bench dynamic --here`` on the tiny UNet with the pack's compile, TorchCompileModel and the
    first room's timing failing: each failure is a row of its own, the next room's eager row is
    still measured, every row printed as it came (the table's lines in the same order)."""
    import json

    from unet_compiler.bench import dynamic as D  # noqa: N812
    from unet_compiler.nodes import patcher

    def no_compile(*args, **kwargs):
        raise RuntimeError("the pack did not compile (the test)")
    monkeypatch.setattr(patcher, "compile_model", no_compile)

    def no_torch_compile(*args, **kwargs):
        raise RuntimeError("TorchCompileModel did not compile (the test)")
    monkeypatch.setattr(D, "torch_compile_model", no_torch_compile)
    timed, real = [], D._median_ms

    def median(fns, iters, device):
        timed.append(list(fns))
        if len(timed) == 1:
            raise torch.OutOfMemoryError("the first room ran out of memory (the test)")
        return real(fns, iters, device)
    monkeypatch.setattr(D, "_median_ms", median)
    assert D.main(["--here", "--size", "tiny", "--device", "cpu", "--dtype", "fp32", "--iters", "1", "--rooms", "1,0"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [json.loads(ln[len(D.ROW_TAG):]) for ln in out if ln.startswith(D.ROW_TAG)]
    assert [(r["room"], r["path"], bool(r.get("error"))) for r in rows] == [
        (None, D.NAMES["pack"], True), (1.0, "eager, Compile UNet", True), (0.0, D.NAMES["eager"], False),
        (None, D.NAMES["whole"], True)]
    assert "OutOfMemoryError: the first room ran out of memory" in rows[1]["error"]
    table = [ln for ln in out if ln.startswith("| ") and not ln.startswith("| VBAR")]
    assert [ln.split(" | ")[:2] for ln in table] == [["| -", D.NAMES["pack"]], ["| 100%", "eager, Compile UNet"],
                                                      ["| 0%", D.NAMES["eager"]], ["| -", D.NAMES["whole"]]]
    assert out.index(table[0]) < [i for i, ln in enumerate(out) if ln.startswith(D.ROW_TAG)][1]   # printed as it came
