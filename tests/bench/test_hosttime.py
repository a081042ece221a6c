"""bench/hosttime.py (``python -m unet_compiler.bench hosttime``): on the meta device with the pack's
Triton launches stubbed, the triton backend runs every region on its kernels (none falls back to the
model's own code), replaying graphs launch no kernel, and each launcher's call is counted."""
from __future__ import annotations

import pytest

pytest.importorskip("diffusers", reason="diffusers not installed")
pytest.importorskip("triton", reason="triton not installed")


def test_steps_on_meta_count_launches_and_the_packs_time():
    import torch
    from unet_compiler.bench import hosttime as H  # noqa: N812
    from unet_compiler.compiler import graphs as G  # noqa: N812
    state, autocast = G._autocast_state, torch.is_autocast_enabled
    eager, plain, graphed, whole = H.step_rows("tiny", 1)
    assert G._autocast_state is state and torch.is_autocast_enabled is autocast   # nothing left patched
    assert eager["triton_launches"] == 0 and eager["torch_ops"] > 0
    assert plain["regions"] > 0 and plain["region_calls_eager"] == 0 and plain["triton_launches"] > 0
    assert plain["pack_ms"] > 0
    assert graphed["triton_launches"] == 0 and graphed["graph_replays"] > 0 and graphed["region_calls_eager"] == 0
    assert graphed["torch_ops"] < plain["torch_ops"]
    # the replay path timed unprofiled: every region call of a step made again, each one replaying
    assert plain["replay_wall_ms"] is None and graphed["replay_wall_ms"] > 0
    assert graphed["region_calls"] >= graphed["regions"]
    # one graph per UNet call: no kernel launch, a handful of torch ops (the inputs copied in, the output
    # copied out), one replay a step, timed unprofiled as a whole step
    assert whole["triton_launches"] == 0 and whole["graph_replays"] > 0 and whole["region_calls_eager"] == 0
    assert whole["torch_ops"] < graphed["torch_ops"] and whole["replay_wall_ms"] > 0


def test_each_launcher_alone():
    from unet_compiler.bench import hosttime as H  # noqa: N812
    import torch
    from unet_compiler.kernels import _common
    before = (_common._BIND_CHECKED, _common.BIND, hasattr(torch._C, "_cuda_getCurrentRawStream"))
    rows = {r["kernel"].split()[0]: r for r in H.kernel_rows(1)}
    assert rows["groupnorm_silu"]["launches"] == 3 and rows["geglu"]["launches"] == 1
    assert all(r["host_us"] > 0 for r in rows.values())
    # after a signature's first call every launch is a direct one (kernels/_common.Launch)
    assert all(r["jit_launches"] == 0 for r in rows.values()), rows
    assert (_common._BIND_CHECKED, _common.BIND, hasattr(torch._C, "_cuda_getCurrentRawStream")) == before


def test_direct_launches_skip_tritons_dispatch():
    """``hosttime --dispatch``: bias_residual compiled for sm_90 with no GPU (its launcher a counter),
    timed with every launch through triton's JIT and with direct launches of the compiled kernel:
    one launch a call either way, and the direct path costs less than triton's dispatch (13.5 vs
    5.2 µs a call on the 2-core VM, docs/bench.md)."""
    from unet_compiler.bench import hosttime as H  # noqa: N812
    rows = {r["path"]: r for r in H.dispatch_rows(3, "bias_residual")}
    assert set(rows) == set(H.DISPATCH_PATHS) and all(r["launches"] == 1 for r in rows.values()), rows
    assert rows["direct"]["host_us"] < rows["through triton's JIT"]["host_us"], rows


def test_slot_checks_of_a_whole_call_under_dynamic_vram(comfy):
    """``hosttime --slots``: ComfyUI's own tiny UNet under the Dynamic VRAM double, every slot
    resident: a whole call's slot checks and each region's casts are timed, each leaf's weights counted
    once."""
    from unet_compiler.bench import hosttime as H  # noqa: N812
    (row,) = H.slot_rows(["tiny"], 1)
    assert row["size"] == "tiny" and row["leaves"] > 0 and row["weights"] >= row["leaves"] // 2, row
    assert row["regions"] > 0 and 0 < row["whole_min_ms"] <= row["whole_median_ms"], row
    assert 0 < row["regions_min_ms"] <= row["regions_median_ms"], row
