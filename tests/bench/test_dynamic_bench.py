"""``bench dynamic`` (bench/dynamic.py) on a machine without a GPU: the double's comfy-aimdo VBAR for
a CUDA load device (tests/_dynamic_vram.CudaVBAR) driven through comfy-aimdo's real Python API
(``ModelVBAR``, ``vbar_fault`` / ``vbar_unpin``) over a stand-in of its native library, so the GPU
call's wiring is checked here; the rows themselves run in CI's side lane (the tiny UNet) and on a
GPU in the GPU check."""
from __future__ import annotations

import ctypes

import pytest
import torch


class _Lib:
    """comfy-aimdo's native library as its Python side calls it (``model_vbar.py``, ``control.py``):
    one VBAR at a base address over CPU memory; each call recorded."""

    BASE = 1 << 40

    def __init__(self):
        self.calls = []
        self.memory = torch.zeros(1 << 20, dtype=torch.uint8)

    def get_devctx(self, device_id):
        return 7

    def vbar_allocate(self, devctx, size, device, callback):
        self.calls.append(("allocate", size, device))
        return 99

    def vbar_get(self, devctx, ptr):
        return self.BASE

    def vbar_fault(self, devctx, ptr, offset, size, signature):
        self.calls.append(("fault", offset, size))
        signature[0] = 1
        return 0

    def vbar_unpin(self, devctx, ptr, offset, size):
        self.calls.append(("unpin", offset, size))
        return True

    def vbar_set_watermark_limit(self, devctx, ptr, size):
        self.calls.append(("watermark", size))

    def vbar_loaded_size(self, devctx, ptr):
        return 4096

    def vbar_free_memory(self, devctx, ptr, size):
        self.calls.append(("free", size))
        return size


def test_the_gpu_vbar_goes_through_comfy_aimdos_own_api(monkeypatch):
    aimdo = pytest.importorskip("comfy_aimdo.model_vbar", reason="comfy-aimdo not installed (bin/setup installs it)")
    import comfy_aimdo.control as control
    import comfy_aimdo.torch as aimdo_torch

    from unet_compiler.tests._dynamic_vram import CudaVBAR
    lib = _Lib()
    monkeypatch.setattr(control, "lib", lib)
    monkeypatch.setattr(aimdo, "lib", lib)
    monkeypatch.setattr(control, "devctxs", [7])
    seen = []

    def to_tensor(alloc, device):
        vbar, address, size = alloc
        seen.append((type(vbar).__name__, address - lib.BASE, size, device))
        return lib.memory[address - lib.BASE:address - lib.BASE + size]
    monkeypatch.setattr(aimdo_torch, "aimdo_to_tensor", to_tensor)
    v = CudaVBAR(1 << 20, 1000, torch.device("cuda", 0))
    a, b = v.alloc(300), v.alloc(700)
    assert a[0] is v and a[1] == lib.BASE and b[1] == lib.BASE + 512 and b[2] == 700     # aimdo's 512-byte alignment
    sig = aimdo.vbar_fault(b)
    assert isinstance(sig, ctypes.Array) and aimdo.vbar_signature_compare(sig, sig)
    aimdo.vbar_unpin(b)
    v.set_budget(600)
    assert v.free_memory(1e32) == 2**62 and v.loaded_size() == 4096
    assert v.tensor(b).numel() == 700 and seen == [("ModelVBAR", 512, 700, torch.device("cuda", 0))]
    assert lib.calls == [("allocate", 1 << 20, 0), ("watermark", 1000), ("fault", 512, 700), ("unpin", 512, 700),
                         ("watermark", 600), ("free", 2**62)]
