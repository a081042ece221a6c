"""Issue 15's fleet case with two real ComfyUI processes, through the starts benchmark's own code
(``unet_compiler.bench.starts``): a first server fills the pack's compile cache cold; a second server,
given a copy of that folder read-only (a bind mount where this machine allows it) and cold caches
of its own, takes every graph from the cache, compiles no kernel again and writes nothing there."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from unet_compiler.bench import starts


def _files(folder):
    return sorted((p.relative_to(folder).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in folder.rglob("*") if p.is_file())


@pytest.mark.long   # two servers, one compiling cold: minutes (UNET_COMPILER_LONG_TESTS=1)
def test_a_second_worker_on_a_read_only_copy_compiles_nothing(sd15_checkpoint, tmp_path):
    args = SimpleNamespace(px=64, batch=1, steps=1)
    shape = "2x64x64"   # the UNet batch of one image with CFG
    cold_dir = tmp_path / "first"
    pack_cache = cold_dir / "pack_cache"
    env = {"UNET_COMPILER_CACHE_DIR": str(pack_cache), "UNET_COMPILER_CACHE": None,   # the tests' "off" unset
           "TORCHINDUCTOR_CACHE_DIR": None}                                        # the pack places it
    # background off: the report of warmup holds what it compiled (on, the default, the thread does later)
    first = starts.run_row("first worker", cold_dir, sd15_checkpoint, "pack", args, env, shape, background=False)
    assert first.graphs and first.from_cache == 0, first.report
    assert "compile cache: miss" in first.report and "compile cache: saved" in first.report, first.report
    assert list(pack_cache.glob("*.bin")) and (pack_cache / "inductor").is_dir()

    shared = tmp_path / "worker_shared_cache"     # where second_worker copies the folder
    worker = starts.second_worker(pack_cache, tmp_path / "worker", sd15_checkpoint, args, shape, background=False)
    print(f"\nfirst worker: {first.first_s:.1f} s first prompt, {first.graphs} graphs; second worker "
          f"({worker.note}): {worker.first_s:.1f} s, {worker.graphs} graphs ({worker.from_cache} from the cache)")
    assert "compile cache: hit" in worker.report, worker.report
    assert worker.graphs == first.graphs and worker.from_cache == worker.graphs, worker.report
    assert f"warmed {shape}" in worker.report and "0 graph(s) compiled, " in worker.report, worker.report
    assert "compile cache: saved" not in worker.report and "Fix" not in worker.report, worker.report
    for server_root in (cold_dir, tmp_path / "worker"):   # sampling (after the reports) compiled nothing either
        assert "compiled after warmup" not in (server_root / "comfyui.log").read_text(errors="replace")
    if worker.note == "read-only bind mount":
        # nothing written there: the same files, sizes and times as the first worker's (copytree keeps mtimes)
        assert _files(shared) == [f for f in _files(pack_cache) if "/locks/" not in f[0]]
        assert "copied from the read-only folder" in worker.report, worker.report
    # the second prompt (seed only changed) runs on the compiled code: no slower than the first worker's
    assert worker.second_s < 3 * first.second_s + 1.0, (worker.second_s, first.second_s)
    if "copied from the read-only folder" in worker.report:
        # the kernels came with the folder: none was built again in the worker's local copy
        (local,) = (tmp_path / "worker" / "tmp").glob("unet_compiler_inductor_*")
        kernels = {p.relative_to(local): p.stat().st_mtime_ns for p in local.rglob("*.so")}
        assert kernels and kernels == {p.relative_to(shared / "inductor"): p.stat().st_mtime_ns
                                       for p in (shared / "inductor").rglob("*.so")}
    if os.name == "posix" and os.geteuid() == 0:
        assert worker.note in ("read-only bind mount", "file modes a-w (ignored by root: the folder stays writable)")
