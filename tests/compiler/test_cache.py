"""compiler/cache/: the pack's persistent compile cache (torch's Mega-Cache, one entry per
model and setup). A second process with cold torch caches compiles nothing; a bad entry is
never handed to torch's loader; an unwritable folder runs memory-only and says so."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from unet_compiler.compiler import cache as C
from unet_compiler.compiler.lifecycle import variants
from unet_compiler.compiler.config import CompileConfig
from unet_compiler.tests import _cpu_isa
from unet_compiler.compiler.lifecycle.scheduler import process_scheduler


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(C.DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(C.MODE_ENV, raising=False)
    monkeypatch.setattr(C.entry, "_loaded", set())
    return tmp_path / "cache"


def _entry(unet, folder, config=None):
    return C.CompileCache(unet, config or CompileConfig(backend="inductor"), "cpu", process_scheduler())


def test_key_covers_what_the_code_depends_on(tiny_unet, folder, monkeypatch):
    unet = tiny_unet()
    base = _entry(unet, folder).key
    assert _entry(tiny_unet(seed=7), folder).key == base, "weights are graph inputs: not part of the key"
    assert _entry(unet, folder, CompileConfig(backend="inductor", prepack_conv=False)).key != base
    assert _entry(unet, folder, CompileConfig(backend="inductor", precision="bf16")).key != base
    assert _entry(tiny_unet(cross_attention_dim=48), folder).key != base, "another architecture"
    another = C.CompileCache(unet, CompileConfig(backend="inductor"), "meta", process_scheduler())
    assert another.key != base, "another device"
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert _entry(unet, folder).key != base, "another torch"
    monkeypatch.undo()
    monkeypatch.setattr(C.key, "PACK_VERSION", "9.9.9")
    assert _entry(unet, folder).key != base, "another pack version"
    monkeypatch.undo()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")   # code generated for another ISA (NaN once rebuilt)
    assert _entry(unet, folder).key != base, "another CPU ISA override"
    monkeypatch.undo()
    monkeypatch.setattr(C.cpu_isa, "isa_flags", lambda: ["avx2"])   # an AVX2-only machine sharing the folder
    assert _entry(unet, folder).key != base, "another CPU"
    monkeypatch.undo()
    installed = C.key.traced_libraries()
    for lib in ("diffusers", "peft"):   # their modules' code is traced into the variants
        monkeypatch.setattr(C.key, "traced_libraries", lambda lib=lib: {**installed, lib: "9.9"})
        assert _entry(unet, folder).key != base, f"another {lib}"
        monkeypatch.undo()


def _write(entry, data: bytes, **meta_over):
    entry.folder.mkdir(parents=True, exist_ok=True)
    bin_path, meta_path = entry.paths
    bin_path.write_bytes(data)
    meta = {"format": C.FORMAT, "key": entry.key, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    meta.update(meta_over)
    meta_path.write_text(json.dumps(meta))


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "foreign", "no-json"])
def test_a_bad_entry_is_discarded_before_torch_sees_it(tiny_unet, folder, monkeypatch, caplog, damage):
    handed = []
    monkeypatch.setattr(C.megacache, "load", lambda data: handed.append(data))
    entry = _entry(tiny_unet(), folder)
    good = b"artifacts written by the pack" * 10
    _write(entry, good)
    bin_path, meta_path = entry.paths
    if damage == "truncated":
        bin_path.write_bytes(good[:17])
    elif damage == "corrupt":
        bin_path.write_bytes(good[:-1] + b"!")
    elif damage == "foreign":
        _write(entry, good, format="someone-else-1")
    else:
        meta_path.unlink()
    with caplog.at_level("WARNING"):
        assert entry.load() is False
    assert handed == [], "nothing unverified reaches torch's (unpickling) loader"
    assert not bin_path.exists() and not meta_path.exists(), "the bad entry is removed, to be rebuilt"
    assert "discarded" in entry.state and "rebuilt" in entry.state
    assert sum("compile cache entry" in r.getMessage() for r in caplog.records) == 1, "one log line"


def test_a_good_entry_is_loaded_once_per_process(tiny_unet, folder, monkeypatch):
    handed = []
    monkeypatch.setattr(C.megacache, "load", lambda data: handed.append(data))
    monkeypatch.setattr(process_scheduler(), "variants", variants.Variants())
    entry = _entry(tiny_unet(), folder)
    _write(entry, C.pack_entry(b"x" * 2048, {"k1": [b"v1", b"v2"], "k2": [b"v3"]}))
    assert entry.load() and handed == [b"x" * 2048] and entry.state.startswith("hit")
    assert "3 precompiled region variant(s)" in entry.state, entry.state
    pending = {k: [b for _, b in v] for k, v in process_scheduler().variants.pending.items()}
    assert pending == {"k1": [b"v1", b"v2"], "k2": [b"v3"]}, "variants wait for first use"
    assert _entry(tiny_unet(), folder).load() and len(handed) == 1, "loaded once per process"


def test_arm_cpus_that_differ_in_sve_are_other_entries(monkeypatch):
    """Inductor builds SVE code where torch's CPU info reports SVE (Graviton3) and NEON where it does
    not (Graviton2, Apple): a folder two such machines share must not hand one the other's code."""
    import platform
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    neon = {"asimd": True, "sve": False, "sve2": False, "bf16": False, "num_physical_cores": 2}
    sve = {**neon, "sve": True, "bf16": True, "sve_max_length": 256}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: neon)
    first = C.cpu_isa.build_facts()
    assert first["isa"] == ["asimd"], first
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {**neon, "num_physical_cores": 64})
    assert C.cpu_isa.build_facts() == first, "core counts are no ISA"
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: sve)
    assert C.cpu_isa.build_facts()["isa"] == ["asimd", "bf16", "sve", "sve_max_length=256"]
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {**sve, "sve_max_length": 128})
    assert "sve_max_length=128" in C.cpu_isa.build_facts()["isa"]


def test_entry_container_round_trip_and_merge():
    data = C.pack_entry(b"mega", {"b": [b"2"], "a": [b"1", b"11"]})
    assert C.unpack_entry(data) == (b"mega", {"a": [b"1", b"11"], "b": [b"2"]})
    assert C.unpack_entry(C.pack_entry(None, {"a": [b"1"]})) == (None, {"a": [b"1"]})
    for bad in (b"x" * 40, data[:-1], data + b"!"):
        with pytest.raises(ValueError):
            C.unpack_entry(bad)
    merged = C.entry.merge_variants({"a": [b"1"], "b": [b"2"]}, {"a": [b"1", b"3"]})
    assert sorted(merged["a"]) == [b"1", b"3"] and merged["b"] == [b"2"], "the union, each variant once"


def test_unwritable_folder_runs_memory_only_and_says_so(tiny_unet, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(C.DIR_ENV, str(blocker / "cache"))   # mkdir fails (as root too)
    monkeypatch.delenv(C.MODE_ENV, raising=False)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
    entry = _entry(tiny_unet(), tmp_path)
    assert entry.load() is False and entry.state.startswith("miss")
    entry.save()   # never raises
    text = "\n".join(entry.lines())
    assert "not saved" in text and "not writable" in text and C.DIR_ENV in text, text


def test_clear_and_off(tiny_unet, folder, monkeypatch, tmp_path):
    monkeypatch.setattr(C.megacache, "load", lambda data: None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))   # chosen: not placed in the folder
    entry = _entry(tiny_unet(), folder)
    _write(entry, C.pack_entry(b"y" * 100, {}))
    (folder / C.cpu_isa.FILE).write_text("{}")
    monkeypatch.setenv(C.MODE_ENV, "off")
    off = _entry(tiny_unet(), folder)
    assert off.load() is False and "off" in "\n".join(off.lines())
    # and what killed saves left, a lock whose holder is gone, inductor's own folder (the pack put it there)
    (folder / "inductor" / "fxgraph").mkdir(parents=True)
    (folder / "inductor" / "fxgraph" / "artifact").write_bytes(b"old")
    (folder / f"{entry.key}.0123456789abcdef.bin.x.partial").write_bytes(b"part")
    (folder / f"{entry.key}.lock").write_text(f"abc {_dead_pid()} {C.files.machine()}")
    live = folder / "0ther.lock"
    live.write_text(f"abc {os.getpid()} {C.files.machine()}")
    monkeypatch.setenv(C.MODE_ENV, "clear")
    monkeypatch.setattr(C.entry, "_cleared", [False])
    assert _entry(tiny_unet(), folder).load() is False
    assert list(folder.iterdir()) == [live], ("clear empties the folder once, but a live save's lock",
                                              list(folder.iterdir()))


# ---- two processes, real torch caches ------------------------------------------------------
_RUN = textwrap.dedent('''
    import json, time, torch, diffusers
    from unet_compiler.compiler import api
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(**{config}).eval()
    api.compile_unet(unet, "inductor", dynamic_shapes=False)
    t0 = time.perf_counter()
    print(api.warmup(unet, "1x64x64", context_tokens=6))
    from torch._dynamo.utils import counters
    print("STATS", json.dumps(dict(api.accelerator_of(unet).stats, warmup_s=time.perf_counter() - t0,
                                   traced=counters["stats"]["unique_graphs"])))
''')


def _run(env, unet_config: dict) -> str:
    code = _RUN.format(config=repr(unet_config))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


def _stats(out: str) -> dict:
    return json.loads(out.split("STATS", 1)[1])


@pytest.mark.long   # three processes compiling: minutes (CI: test_a_restart_runs_no_probe_shape_its_entry_holds_the_code_of)
def test_restart_and_second_worker_compile_nothing(tmp_path, tiny_unet):
    """1: cold, nothing anywhere. 2: a restart: the pack's folder holds its entry and torch's own
    caches (the pack placed them there). 3: a second worker on another machine: only the pack's
    folder (the entry), torch's caches cold. 2 and 3 take every graph from the cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", C.MODE_ENV)}
    env.update(UNET_COMPILER_CACHE_DIR=str(tmp_path / "pack"), TORCH_NUM_THREADS="1")
    first = _run(env, tiny_unet.config())
    assert "compile cache: miss" in first and "compile cache: saved" in first, first
    assert "torch's own inductor cache" in first, first
    assert (tmp_path / "pack" / "inductor").is_dir() and list((tmp_path / "pack").glob("*.bin")), first
    assert "from the compile cache" not in first.split("STATS")[0], first
    restart = _run(env, tiny_unet.config())
    worker = _run(dict(env, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ind2"), TRITON_CACHE_DIR=str(tmp_path / "tri2")),
                  tiny_unet.config())
    assert (tmp_path / "pack" / "cpu_isa.record").is_file(), "inductor's CPU ISA probe outcomes recorded"
    for out in (restart, worker):
        assert "compile cache: hit" in out and "0 graph(s) compiled, " in out and "loaded from the compile cache" in out, out
        assert "CPU ISA probe replayed from its record" in out, out
        assert "compile cache: saved" not in out, "nothing new to save"
        stats = _stats(out)
        assert stats["graphs_compiled"] > 0 and stats["graphs_from_cache"] == stats["graphs_compiled"], stats
        if variants.enabled():
            assert stats["traced"] == 0 and "precompiled region variant(s)" in out, \
                f"the precompiled regions were loaded, nothing was traced: {stats}"
    cold, warm, fleet = (_stats(o)["warmup_s"] for o in (first, restart, worker))
    print(f"\nwarmup: cold {cold:.1f} s, restart {warm:.1f} s ({warm / cold:.0%}), "
          f"second worker (entry only) {fleet:.1f} s ({fleet / cold:.0%})")
    assert warm < cold


def test_read_only_folder_is_read_and_said_plainly(tiny_unet, folder, monkeypatch):
    """A fleet's shared read-only mount (simulated: root ignores file modes): nothing is written,
    and the report says read-only, not 'fix this'."""
    folder.mkdir(parents=True)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))

    def refuse(path, data):
        raise PermissionError(13, "Read-only file system")
    monkeypatch.setattr(C.CompileCache, "_atomic_write", staticmethod(refuse))
    real_writable = C.files.writable
    monkeypatch.setattr(C.files, "writable", lambda p: Path(p) != folder and real_writable(p))
    entry = _entry(tiny_unet(), folder)
    monkeypatch.setitem(C.cpu_isa._new, "avx2|-mavx2|0", True)   # an ISA check this process made
    entry.save()
    text = "\n".join(entry.lines())
    assert "is read-only: its entries are read" in text and "Fix" not in text, text
    assert not any(folder.iterdir()), "nothing written, the CPU ISA record neither"
    assert not list(folder.glob("*.bin"))


# ---- an entry keeps everything: saves after warmup, and what another worker added --------------
_STEPS = textwrap.dedent('''
    import json, sys, torch
    from torch._dynamo.utils import counters
    from unet_compiler.compiler import cache as C
    from unet_compiler.compiler.config import CompileConfig
    from unet_compiler.compiler.lifecycle.scheduler import process_scheduler
    fns = {"sin": lambda x: x.sin() + 1, "cos": lambda x: x.cos() * 2, "tanh": lambda x: x.tanh() - 3}
    entry = C.CompileCache(torch.nn.Linear(2, 2), CompileConfig(backend="inductor"), "cpu", process_scheduler())
    entry.load()
    for step in sys.argv[1:]:            # a name compiles and runs that function; "save" saves
        if step == "save":
            entry.save()
        else:
            torch.compile(fns[step])(torch.randn(8))
    print("STATE", json.dumps({"hits": counters["inductor"]["fxgraph_cache_hit"],
                               "misses": counters["inductor"]["fxgraph_cache_miss"], "state": entry.state}))
''')


def _steps(tmp_path, name, *steps) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (C.MODE_ENV, "TRITON_CACHE_DIR")}
    env.update({C.DIR_ENV: str(tmp_path / "pack"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor_{name}"),
                "TORCH_NUM_THREADS": "1"})    # a cold inductor cache per process: only the entry carries code
    proc = subprocess.run([sys.executable, "-c", _STEPS, *steps], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return json.loads(proc.stdout.split("STATE", 1)[1])


@pytest.mark.long   # workers compiling in turn: minutes (CI: test_two_processes_saving_one_entry_lose_nothing)
def test_an_entry_keeps_every_save_and_every_workers_graphs(tmp_path):
    """torch's loader keeps only the last of several saves of one process (a shape compiled after
    warmup saves again), and a worker that loaded an entry saves only what it compiled itself. The
    pack merges: after a process saved twice and a second worker added a third graph, a fresh
    process takes all three from the entry."""
    from unet_compiler.compiler.cache import megacache
    first = _steps(tmp_path, "a", "sin", "save", "cos", "save")
    assert first["misses"] == 2 and first["state"].startswith("miss"), first
    (entry,) = (tmp_path / "pack").glob("*.bin")
    assert megacache.count(C.unpack_entry(entry.read_bytes())[0]) >= 2
    fresh = _steps(tmp_path, "b", "sin", "cos")
    assert fresh["hits"] == 2 and fresh["misses"] == 0, f"both saves of one process are loaded: {fresh}"
    worker = _steps(tmp_path, "c", "sin", "tanh", "save")
    assert worker["hits"] == 1 and worker["misses"] == 1, worker
    last = _steps(tmp_path, "d", "sin", "cos", "tanh")
    assert last["hits"] == 3 and last["misses"] == 0, f"the worker added to the entry, lost nothing: {last}"


def test_a_read_only_folder_lends_its_inductor_files_through_a_local_copy(tiny_unet, folder, tmp_path, monkeypatch):
    """Inductor writes beside what it reads, so a fleet's read-only folder cannot be its cache
    folder: its ``inductor/`` is copied to a local temp folder, which inductor then uses."""
    kernel = folder / "inductor" / "ab" / "kernel.so"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"compiled")
    (folder / "inductor" / "locks").mkdir()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "local_tmp"))
    real_writable = C.files.writable
    monkeypatch.setattr(C.files, "writable", lambda p: Path(p) != folder / "inductor" and real_writable(p))
    entry = _entry(tiny_unet(), folder)
    entry.load()
    local = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert local.parent == tmp_path / "local_tmp" and (local / "ab" / "kernel.so").read_bytes() == b"compiled"
    assert not (local / "locks").exists()
    assert "copied from the read-only folder to" in "\n".join(entry.lines())


def test_a_restart_runs_no_probe_shape_its_entry_holds_the_code_of(tiny_unet, folder, monkeypatch):
    """The probes a range warmup ran are named in the entry's .json; a restart's warmup runs only
    the listed shapes, every region from the cache, and a shape inside the box compiles nothing."""
    from unet_compiler.compiler import api
    from torch._dynamo.utils import counters
    monkeypatch.setattr(process_scheduler(), "variants", variants.Variants())
    box = "2x64x64, 2x128x128"
    first = tiny_unet()
    api.compile_unet(first, "inductor", dynamic_shapes=True)
    api.warmup(first, box)
    ran = [label for label, _, _ in api.accelerator_of(first).report.warmup if "(probe)" in label]
    assert ran, "the cold warmup ran its probe shapes"
    meta = json.loads(next(folder.glob("*.json")).read_text())
    assert sorted(meta["primed"]) == sorted([label.split(" ")[0] for label in ran] + ["2x64x64", "2x128x128"])

    monkeypatch.setattr(C.entry, "_loaded", set())           # a new process: nothing loaded, nothing live
    monkeypatch.setattr(process_scheduler(), "variants", variants.Variants())
    second = tiny_unet(seed=4)
    api.compile_unet(second, "inductor", dynamic_shapes=True)
    traced = int(counters["stats"]["unique_graphs"])
    text = api.warmup(second, box)
    accel = api.accelerator_of(second)
    assert not any("(probe)" in label for label, _, _ in accel.report.warmup), text
    assert "not run: an earlier warmup ran them" in text
    # the first listed shape ran on code all from the entry: the others are not run (a range's largest
    # shape was most of its restart), and sampling there later compiles nothing
    assert [label for label, _, _ in accel.report.warmup] == \
        ["2x64x64", "2x128x128 (not run: its code is in the compile cache entry)"], accel.report.warmup
    assert "shape(s) 2x128x128 not run: the compile cache entry holds their code" in text, text
    with torch.inference_mode():
        second(torch.randn(2, 4, 12, 16), torch.tensor([5.0, 5.0]), torch.randn(2, 6, 32))
        second(torch.randn(2, 4, 16, 16), torch.tensor([5.0, 5.0]), torch.randn(2, 6, 32))
    assert int(counters["stats"]["unique_graphs"]) == traced, "nothing traced: warmup or the shapes inside the box"
    assert accel.stats["recompiles_after_warmup"] == 0 and process_scheduler().variants.compiled == 0


def test_probes_that_ran_no_compiled_code_are_not_claimed_by_the_entry(tiny_unet, folder, monkeypatch):
    """A warmup whose calls ran only the model's own code (every region kind off here; another pack's
    ops, patches on every region, in use) records no probe shape and no compare in the compile cache
    entry: a later warmup of the same model runs them and the eager reference again, and says
    nothing of code in the entry."""
    from unet_compiler.compiler import api
    monkeypatch.setattr(process_scheduler(), "variants", variants.Variants())
    unet = tiny_unet()
    api.compile_unet(unet, "inductor", dynamic_shapes=True)
    accel = api.accelerator_of(unet)
    accel.failed.update({kind: "off for this test" for kind in accel.report.regions})
    api.warmup(unet, "2x64x64, 2x128x128")
    assert accel.ran_compiled() == (0, sum(accel.report.regions.values()))
    assert accel.cache.primed_probes() == set()
    text = api.warmup(unet, "2x64x64, 2x128x128")
    assert "not run" not in text and "compile cache" not in text.split("compile cache:")[0], text
    assert any("(probe)" in label for label, _, _ in accel.report.warmup) and accel.report.diff_recorded is None


def test_a_restart_shows_the_compare_recorded_when_its_code_was_compiled(tiny_unet, folder, monkeypatch):
    """The cold warmup records its max |compiled - eager| in the entry's .json. A restart whose code
    all comes from that entry shows it, labelled as such, without running the eager reference (most
    of a CPU restart's warmup); UNET_COMPILER_COMPARE=always runs it; code compiled anew runs it too."""
    from unet_compiler.compiler import api
    monkeypatch.delenv("UNET_COMPILER_COMPARE", raising=False)
    monkeypatch.setattr(process_scheduler(), "variants", variants.Variants())
    first = tiny_unet()
    api.compile_unet(first, "inductor")
    api.warmup(first, "2x64x64")
    cold = api.accelerator_of(first)
    assert cold.stats["eager_calls"] == 1 and cold.report.diff_recorded is None
    recorded = json.loads(next(folder.glob("*.json")).read_text())["compares"]["2x64x64"]
    assert recorded["max_abs_diff"] == cold.report.max_abs_diff

    def restart(seed, compare=None):
        monkeypatch.setattr(C.entry, "_loaded", set())           # a new process: nothing loaded, nothing live
        monkeypatch.setattr(process_scheduler(), "variants", variants.Variants())
        if compare:
            monkeypatch.setenv("UNET_COMPILER_COMPARE", compare)
        unet = tiny_unet(seed=seed)
        api.compile_unet(unet, "inductor")
        text = api.warmup(unet, "2x64x64")
        return text, api.accelerator_of(unet)

    text, accel = restart(4)
    assert "0 graph(s) compiled, " in text and "loaded from the compile cache" in text, text
    assert accel.stats["eager_calls"] == 0, "the eager reference did not run"
    assert accel.report.max_abs_diff == recorded["max_abs_diff"] and accel.report.diff_recorded == recorded["measured"]
    assert f"measured by an earlier warmup of the same code, {recorded['measured']}" in text
    text, accel = restart(5, compare="always")
    assert accel.stats["eager_calls"] == 1 and accel.report.diff_recorded is None
    assert "measured by an earlier warmup" not in text and "max |compiled - eager| at 2x64x64" in text


def test_a_recorded_compare_is_not_shown_for_code_compiled_anew(tiny_unet, folder, monkeypatch):
    from unet_compiler.compiler import api
    monkeypatch.delenv("UNET_COMPILER_COMPARE", raising=False)
    monkeypatch.setattr(process_scheduler(), "variants", variants.Variants())
    unet = tiny_unet(seed=6)
    api.compile_unet(unet, "inductor")
    accel = api.accelerator_of(unet)
    accel.cache.compares["2x64x64"] = {"max_abs_diff": 123.0, "measured": "long ago"}
    text = api.warmup(unet, "2x64x64")
    assert accel.stats["graphs_compiled"] > accel.stats["graphs_from_cache"], "this test needs code compiled here"
    assert accel.stats["eager_calls"] == 1 and accel.report.diff_recorded is None
    assert accel.report.max_abs_diff < 1e-3 and "long ago" not in text


@pytest.fixture
def isa_probe(monkeypatch):
    """compiler/cache/cpu_isa.py around a stand-in for inductor's ISA probe that counts its calls."""
    from torch._inductor import cpu_vec_isa

    from unet_compiler.compiler.cache import cpu_isa
    _cpu_isa.uninstall()
    calls = []

    def probe(self, code):
        calls.append(str(self))
        return "avx512" not in str(self)
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", probe)
    yield cpu_isa, cpu_vec_isa, calls
    _cpu_isa.uninstall()


def test_inductors_isa_probe_is_replayed_where_the_machine_matches(isa_probe, tmp_path, monkeypatch):
    cpu_isa, vec, calls = isa_probe
    cpu_isa.install(tmp_path)
    outcomes = [vec.VecAVX2().check_build("int main(){}"), vec.VecAVX512().check_build("int main(){}")]
    assert outcomes == [True, False] and len(calls) == 2, (outcomes, calls)
    assert not (tmp_path / cpu_isa.FILE).exists(), "written at a save, not at the probe"
    cpu_isa.save(tmp_path)
    _cpu_isa.uninstall()

    # a new process (simulated): the success is replayed, the failure (maybe a timeout) probed again
    cpu_isa.install(tmp_path)
    again = [vec.VecAVX2().check_build("int main(){}"), vec.VecAVX512().check_build("int main(){}")]
    assert again == outcomes and calls[2:] == ["avx512"], (again, calls)
    assert cpu_isa.counts() == {"replayed": 1, "probed": 1}
    vec.VecAVX2().check_build("other code")
    assert len(calls) == 4, "another probe code is probed"
    _cpu_isa.uninstall()

    # another machine (a different compiler, CPU or torch): its record is its own, both are kept
    cpu_isa.machine_key.cache_clear()
    monkeypatch.setattr(cpu_isa, "_compiler_facts", lambda: ["another g++"])
    try:
        cpu_isa.install(tmp_path)
        vec.VecAVX2().check_build("int main(){}")
        assert len(calls) == 5 and cpu_isa.counts() == {"replayed": 0, "probed": 1}
        cpu_isa.save(tmp_path)
        assert len(json.loads((tmp_path / cpu_isa.FILE).read_text())["machines"]) == 2
    finally:
        cpu_isa.machine_key.cache_clear()


def test_the_isa_record_is_off_by_env_and_a_bad_record_is_ignored(isa_probe, tmp_path, monkeypatch):
    cpu_isa, vec, calls = isa_probe
    (tmp_path / cpu_isa.FILE).write_text("{not json")
    cpu_isa.install(tmp_path)
    assert vec.VecAVX2().check_build("x") is True and len(calls) == 1
    cpu_isa.save(tmp_path)   # the bad record is replaced by a good one
    assert cpu_isa.machine_key() in json.loads((tmp_path / cpu_isa.FILE).read_text())["machines"]
    _cpu_isa.uninstall()
    monkeypatch.setenv("UNET_COMPILER_CPU_ISA_RECORD", "off")
    cpu_isa.install(tmp_path)
    vec.VecAVX2().check_build("x")
    assert len(calls) == 2, "off: inductor probes as it always does"


def test_a_read_only_folder_gets_no_isa_record(isa_probe, tmp_path, monkeypatch):
    cpu_isa, vec, calls = isa_probe
    cpu_isa.install(tmp_path)
    vec.VecAVX2().check_build("x")
    real_writable = cpu_isa.files.writable
    monkeypatch.setattr(cpu_isa.files, "writable", lambda p: Path(p) != tmp_path and real_writable(p))
    cpu_isa.save(tmp_path)
    assert not any(tmp_path.iterdir())


# ---- Windows file semantics, simulated ------------------------------------------------------
def test_a_file_another_process_holds_open_is_retried_not_given_up(tmp_path, monkeypatch):
    """Windows refuses to replace a file another process has open (PermissionError): the write waits
    and tries again; a lock that never goes away still fails, after the retries."""
    real, refused = os.replace, []

    def locked_twice(src, dst):
        if len(refused) < 2:
            refused.append(dst)
            raise PermissionError(13, "The process cannot access the file")
        return real(src, dst)
    monkeypatch.setattr(C.files, "RETRY_SECONDS", (0.01,) * 3)
    monkeypatch.setattr(os, "replace", locked_twice)
    C.files.atomic_write(tmp_path / "entry.bin", b"new")
    assert (tmp_path / "entry.bin").read_bytes() == b"new" and len(refused) == 2
    monkeypatch.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(PermissionError(13, "locked")))
    with pytest.raises(PermissionError):
        C.files.atomic_write(tmp_path / "entry.bin", b"newer")
    assert (tmp_path / "entry.bin").read_bytes() == b"new" and not list(tmp_path.glob("*.partial"))


def test_writable_is_tried_not_assumed(tmp_path, monkeypatch):
    """os.access says yes for every folder on Windows: writability is a real file created and removed."""
    assert C.files.writable(tmp_path) and not list(tmp_path.iterdir())
    assert not C.files.writable(tmp_path / "missing")

    def refuse(**kw):
        raise PermissionError(13, "Access is denied")
    monkeypatch.setattr(os, "access", lambda p, mode: True)
    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    assert not C.files.writable(tmp_path)


def test_an_entry_read_while_another_process_saves_it_is_not_discarded(tiny_unet, folder, monkeypatch):
    """A save replaces .bin then .json: a reader between the two sees a mismatch. It reads again
    before it discards anything, so another worker's good entry survives."""
    entry = _entry(tiny_unet(), folder)
    data = C.pack_entry(b"mega", {})
    _write(entry, data)
    real_read, reads = C.CompileCache._read, []

    def mid_save(self):
        reads.append(1)
        return (b"half", "sha256 mismatch (corrupt)") if len(reads) == 1 else real_read(self)
    monkeypatch.setattr(C.CompileCache, "_read", mid_save)
    monkeypatch.setattr(C.megacache, "load", lambda data: None)
    assert entry.load() and len(reads) == 2, entry.state
    assert all(p.is_file() for p in entry.paths), "the good entry is kept"


def test_a_long_cache_path_on_windows_gets_a_short_inductor_root(tmp_path, monkeypatch):
    """Inductor adds 120-150 characters below its folder: a portable build in Downloads would pass
    Windows' 260-character limit, so its files go to a short folder under %LOCALAPPDATA%."""
    from unet_compiler.compiler.cache import torch_dirs
    deep = Path(r"C:\Users\someone\Downloads\ComfyUI_windows_portable_nvidia\ComfyUI_windows_portable"
                r"\ComfyUI\user\unet_compiler\compile_cache")
    monkeypatch.setenv("LOCALAPPDATA", r"C:\Users\someone\AppData\Local")
    short = torch_dirs.short_root(deep, system="Windows")
    assert len(str(short)) <= 50 and str(short).startswith(r"C:\Users\someone\AppData\Local")
    assert torch_dirs.short_root(deep, system="Windows") == short, "one folder per cache folder"
    assert torch_dirs.short_root(deep, system="Linux") == deep / "inductor"
    near = Path(r"C:\ComfyUI\user\unet_compiler\compile_cache")
    assert torch_dirs.short_root(near, system="Windows") == near / "inductor", "short enough: beside the entries"


_SAVER = textwrap.dedent('''
    import hashlib, sys, time, torch
    from unet_compiler.compiler import cache as C
    from unet_compiler.compiler.lifecycle.scheduler import process_scheduler
    from unet_compiler.compiler.config import CompileConfig
    name, rounds, start = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    torch.compiler.save_cache_artifacts = lambda: (b"", None)     # only the variants: no compile needed
    pack = C.entry.pack_entry
    def slow_pack(*a):                                             # a large entry: a wide read-to-write window
        time.sleep(0.02)
        return pack(*a)
    C.entry.pack_entry = slow_pack
    entry = C.CompileCache(torch.nn.Linear(2, 2), CompileConfig(backend="inductor"), "cpu", process_scheduler())
    while time.time() < start:                                     # both start together
        time.sleep(0.001)
    for i in range(rounds):
        process_scheduler().variants.blobs.clear()     # each save adds one variant to what is on disk
        blob = f"{name}-{i}".encode() * 50
        process_scheduler().variants.blobs[f"key-{name}"][hashlib.sha256(blob).hexdigest()] = blob
        entry.save()
        assert not entry.problem, entry.problem
        fresh = C.CompileCache(torch.nn.Linear(2, 2), CompileConfig(backend="inductor"), "cpu", process_scheduler())
        data, why = fresh._read()                                   # a reader while the other one saves
        assert not why, why
    print("ok")
''')


def test_two_processes_saving_one_entry_lose_nothing(folder):
    """Two real processes save into one entry at the same time, reading it between saves: every
    variant of both is in the entry at the end (without the entry's lock file, measured: 12 and 2
    of 12 kept), and no read ever saw a broken entry."""
    env = {k: v for k, v in os.environ.items() if k != C.MODE_ENV}
    env.update({C.DIR_ENV: str(folder), "TORCHINDUCTOR_CACHE_DIR": str(folder.parent / "inductor_x")})
    start = str(time.time() + 10)
    procs = [subprocess.Popen([sys.executable, "-c", _SAVER, name, "12", start], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    # the entry the two wrote (its key is theirs: this process may know another ComfyUI version)
    (meta_path,) = folder.glob("*.json")
    meta = json.loads(meta_path.read_text())
    data = (folder / meta["bin"]).read_bytes()
    assert hashlib.sha256(data).hexdigest() == meta["sha256"]
    _, found = C.unpack_entry(data)
    assert {k: len(v) for k, v in found.items()} == {"key-a": 12, "key-b": 12}
    assert len(list(folder.glob("*.bin"))) == 1 and not list(folder.glob("*.lock")), list(folder.iterdir())


def test_a_background_restart_of_a_range_runs_only_its_first_shape(tiny_unet, folder, monkeypatch):
    """The same restart with Warmup Shapes' default (background) on a CPU: the first listed shape
    runs the model's own code, its code left to load from the entry once nothing samples, and the
    other listed shapes are not run either; once loaded, shapes inside the box compile nothing."""
    from unet_compiler.compiler import api
    from unet_compiler.compiler.lifecycle import pacing
    from torch._dynamo.utils import counters
    monkeypatch.setattr(process_scheduler(), "variants", variants.Variants())
    monkeypatch.setattr(pacing, "QUIET_SECONDS", 0.2)
    box = "2x64x64, 2x128x128"
    first = tiny_unet()
    api.compile_unet(first, "inductor", dynamic_shapes=True)
    api.warmup(first, box)

    monkeypatch.setattr(C.entry, "_loaded", set())           # a new process: nothing loaded, nothing live
    monkeypatch.setattr(process_scheduler(), "variants", variants.Variants())
    second = tiny_unet(seed=4)
    api.compile_unet(second, "inductor", dynamic_shapes=True)
    traced = int(counters["stats"]["unique_graphs"])
    text = api.warmup(second, box, background=True)
    accel = api.accelerator_of(second)
    assert [label for label, _, _ in accel.report.warmup] == \
        ["2x64x64 (recorded for the background compile)",
         "2x128x128 (not run: its code is in the compile cache entry)"], accel.report.warmup
    assert accel.background.owner.deferred > 0 and accel.stats["graphs_compiled"] == 0, text
    assert api.wait_for_background(300)
    assert accel.background.owner.loaded > 0 and accel.background.owner.variants == 0, accel.text()
    with torch.inference_mode():
        second(torch.randn(2, 4, 12, 16), torch.tensor([5.0, 5.0]), torch.randn(2, 6, 32))
        second(torch.randn(2, 4, 16, 16), torch.tensor([5.0, 5.0]), torch.randn(2, 6, 32))
    assert int(counters["stats"]["unique_graphs"]) == traced, "nothing traced: every variant from the entry"


def test_a_failed_save_leaves_no_orphan_and_the_next_save_writes(tiny_unet, folder, monkeypatch):
    """A disk full while the .json commits: the new .bin goes (no orphan no .json names), the report
    says the save is tried again, and the next save writes the entry. Before, one such failure turned
    saving off for the process and left the .bin behind."""
    folder.mkdir(parents=True)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
    real = C.CompileCache._atomic_write
    full = [True]

    def write(path, data):
        if full[0] and str(path).endswith(".json"):
            raise OSError(28, "No space left on device")
        return real(path, data)
    monkeypatch.setattr(C.CompileCache, "_atomic_write", staticmethod(write))
    entry = _entry(tiny_unet(), folder)
    entry.save()
    assert not list(folder.glob("*.bin")) and not list(folder.glob("*.json"))
    assert "could not be written (No space left on device)" in "\n".join(entry.lines())
    full[0] = False
    entry.save()
    assert len(list(folder.glob("*.bin"))) == 1 and len(list(folder.glob("*.json"))) == 1
    assert "not saved" not in "\n".join(entry.lines())


def test_a_lock_is_removed_only_by_its_holder_and_a_fresh_one_is_never_broken(tmp_path, monkeypatch):
    """Two savers: one holds the lock past ``stale`` and the other breaks it and takes its own; the
    first, leaving, must not remove the second's. And a stale lock replaced by a fresh one between
    the look and the break is put back. Before, both removed whatever lock was there (two holders
    at once in a review's repro, and a lock left behind)."""
    files = C.files
    path = tmp_path / "k.lock"
    first, second = files.lock(path, stale=0.0), files.lock(path, timeout=1, stale=0.0)
    assert first.__enter__()
    time.sleep(0.01)
    assert second.__enter__()                    # judged the first's lock stale, broke it, took its own
    theirs = path.read_bytes()
    first.__exit__(None, None, None)             # the first leaves: the second's lock stays
    assert path.read_bytes() == theirs
    second.__exit__(None, None, None)
    assert not path.exists()
    path.write_bytes(b"old")                     # a stale lock ...
    real = files._token
    calls = []

    def token(p):                                # ... that another process breaks and takes anew
        calls.append(p)                          # between this process's look and its move
        got = real(p)
        if len(calls) == 1:
            p.write_bytes(b"fresh")
        return got
    monkeypatch.setattr(files, "_token", token)
    files._break_stale(path)
    assert path.read_bytes() == b"fresh" and not list(tmp_path.glob("*.stale"))


def _dead_pid() -> int:
    """The pid of a process that has exited (a killed ComfyUI's)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_a_lock_left_by_a_killed_process_is_broken_at_once(tmp_path):
    """A ComfyUI killed while saving leaves its lock: the next save on this machine breaks it at once,
    where before each save in the next two minutes waited its whole 30 s timeout. A live holder's lock
    and another machine's are waited for as before."""
    import platform
    files = C.files
    path = tmp_path / "k.lock"
    path.write_bytes(f"abc {_dead_pid()} {files.machine()}".encode())
    t0 = time.monotonic()
    with files.lock(path, timeout=10) as held:
        assert held and time.monotonic() - t0 < 2
        assert path.read_bytes().split()[1:] == [str(os.getpid()).encode(), files.machine().encode()]
    # a live holder; another machine's, or another pid namespace's on this host (a container sharing
    # the volume and the host name); a token of another format
    for holder in (f"abc {os.getpid()} {files.machine()}", f"abc {_dead_pid()} another-machine",
                   f"abc {_dead_pid()} {platform.node()}/pid:[1]", "abc"):
        path.write_bytes(holder.encode())
        with files.lock(path, timeout=0.3) as held:
            assert not held, holder
        assert path.read_bytes() == holder.encode(), "not its lock: left as it was"


def test_a_save_removes_what_killed_saves_left(tiny_unet, folder, monkeypatch):
    """A process killed between writing its .bin and its .json, or mid-write, leaves files no .json
    names: the next save of that entry removes them once they are old enough that no save still
    writes or commits them (a lock broken by mistake costs nothing); other entries' files stay."""
    folder.mkdir(parents=True)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
    entry = _entry(tiny_unet(), folder)
    orphan, fresh_bin = folder / f"{entry.key}.0123456789abcdef.bin", folder / f"{entry.key}.fedcba9876543210.bin"
    old_partial, fresh_partial = folder / f"{entry.key}.json.a.partial", folder / f"{entry.key}.json.b.partial"
    other = folder / "0ther.0123456789abcdef.bin"
    for p in (orphan, fresh_bin, old_partial, fresh_partial, other):
        p.write_bytes(b"left")
    hour_ago = time.time() - 3600
    for p in (orphan, old_partial, other):
        os.utime(p, (hour_ago, hour_ago))
    entry.save()
    meta = json.loads((folder / f"{entry.key}.json").read_text())
    assert sorted(p.name for p in folder.iterdir()) == sorted([meta["bin"], f"{entry.key}.json", fresh_partial.name,
                                                                fresh_bin.name, other.name])


def test_an_entry_holds_only_its_models_variants(tiny_unet, folder, monkeypatch):
    """Two models of other architectures compiled in one process: each one's compile cache entry holds
    the precompiled variants its own calls met, not the other's (before: every variant of the process
    went into every entry saved after it, and a restart loaded and preloaded the other model's code)."""
    from unet_compiler.compiler import api
    store = variants.Variants()
    monkeypatch.setattr(process_scheduler(), "variants", store)
    first, second = tiny_unet(), tiny_unet(cross_attention_dim=48)
    for unet in (first, second):
        api.compile_unet(unet, "inductor", dynamic_shapes=False)
    g = torch.Generator().manual_seed(0)

    def call(unet, width, side):
        with torch.inference_mode():
            unet(torch.randn(1, 4, side, side, generator=g), torch.tensor([10.0]), torch.randn(1, 6, width, generator=g))

    def held(unet):
        key = api.accelerator_of(unet).cache.key
        meta = json.loads((folder / f"{key}.json").read_text())
        return set(C.unpack_entry((folder / meta["bin"]).read_bytes())[1])
    call(first, 32, 8)
    before = set(store.blobs)
    call(second, 48, 8)
    only_second = set(store.blobs) - before      # (its attention's width: the other blocks serve both)
    call(first, 32, 12)                          # the first saves again, after the second's code exists
    assert only_second and not held(first) & only_second, sorted(held(first) & only_second)
    assert held(second) <= before | only_second and only_second <= held(second)


def test_entries_unused_for_days_are_removed_at_a_save(tiny_unet, folder, monkeypatch):
    """Every torch, ComfyUI or pack update (and every other setup) starts an entry of its own, and
    none was ever removed (a reviewer: three ComfyUI versions, three entries). A save removes the
    other entries no process loaded or saved for ``UNET_COMPILER_CACHE_DAYS`` days (30), each under
    its lock taken without waiting; a load marks its entry used; 0 keeps everything."""
    folder.mkdir(parents=True)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
    old = time.time() - 40 * 86400

    def entry(key, age=old, locked=False, meta=True):
        if meta:
            (folder / f"{key}.json").write_text(json.dumps({"key": key, "format": C.FORMAT}))
        (folder / f"{key}.0123456789abcdef.bin").write_bytes(b"x" * 1024)
        for p in folder.glob(f"{key}.*"):
            os.utime(p, (age, age))
        if locked:
            (folder / f"{key}.lock").write_text(f"abc {os.getpid()} {C.files.machine()}")
    stale, fresh, busy, orphan, in_use, md5 = "a" * 32, "b" * 32, "c" * 32, "d" * 32, "e" * 32, "f" * 32
    entry(stale)
    entry(fresh, age=time.time() - 86400)
    entry(busy, locked=True)
    entry(orphan, meta=False)            # (a .bin an eviction killed midway left: no .json names it)
    entry(in_use)
    monkeypatch.setattr(C.entry, "_loaded", {in_use})   # (loaded by this process: in use, however old)
    for name in ("notes.json", f"{md5}.json", f"{md5}.thumbnail.bin"):   # another program's files
        (folder / name).write_text("{}")
        os.utime(folder / name, (old, old))
    monkeypatch.setenv(C.entry.settings.env("CACHE_DAYS"), "0")
    keep = _entry(tiny_unet(), folder)
    keep.save()
    assert (folder / f"{stale}.json").exists() and keep.evicted == (0, 0)
    monkeypatch.setenv(C.entry.settings.env("CACHE_DAYS"), "nan")      # (not a number of days: the default)
    e = _entry(tiny_unet(seed=1), folder)
    e._dirty = True
    e.save()
    names = {p.name for p in folder.iterdir()}
    assert not any(n.startswith((stale, orphan)) for n in names), sorted(names)
    assert {f"{fresh}.json", f"{busy}.json", f"{busy}.lock", f"{in_use}.json", "notes.json", f"{md5}.json",
            f"{md5}.thumbnail.bin", f"{e.key}.json"} <= names, sorted(names)
    size = len(json.dumps({"key": stale, "format": C.FORMAT})) + 2 * 1024
    assert e.evicted == (2, size) and "removed 2 entr(ies) no process used for 30 days" in "\n".join(e.lines())
    json_path = folder / f"{e.key}.json"
    os.utime(json_path, (old, old))
    monkeypatch.setattr(C.entry, "_loaded", set())
    monkeypatch.setattr(C.megacache, "load", lambda data: None)
    assert _entry(tiny_unet(), folder).load() and json_path.stat().st_mtime > old + 86400, "a load marks it used"
    os.utime(json_path, (old, old))
    assert _entry(tiny_unet(), folder).load() and json_path.stat().st_mtime > old + 86400, "so does a load in-process"


def test_the_code_digest_reads_every_file_its_patterns_name():
    """The key's digest of the pack's compiled code: each pattern names a file (the precompiled
    variants' modules moved to compiler/lifecycle/ and their patterns matched nothing, so a change of
    the variants' format was no new key)."""
    from unet_compiler.compiler.cache import key
    names = {p.relative_to(p.parents[1]).as_posix() if p.parent.name in ("lifecycle", "passes", "backends")
             else p.name for p in key.compiled_files()}
    for pattern in key._COMPILED_CODE:
        assert any(Path(n).match(pattern) for n in names), (pattern, sorted(names))
    assert {"lifecycle/precompiled.py", "lifecycle/variants.py", "regions.py"} <= names


def test_a_variant_found_stale_at_a_restart_leaves_the_entry(tiny_unet, folder, monkeypatch):
    """A restart after an update (or with another function set where one traced) rejects a variant of
    the entry and compiles its region again: the entry's next save leaves the rejected one out, so the
    restart after does not load, reject and warn about it again (before: it stayed in the entry for
    good and the entry grew by a set of variants with each update)."""
    import dataclasses

    from unet_compiler.compiler import api
    store = variants.Variants()
    monkeypatch.setattr(process_scheduler(), "variants", store)
    first = tiny_unet()
    api.compile_unet(first, "inductor", dynamic_shapes=False)
    text = api.warmup(first, "1x64x64", context_tokens=6)
    assert "saved" in text, text
    key = api.accelerator_of(first).cache.key

    def held():
        meta = json.loads((folder / f"{key}.json").read_text())
        return C.unpack_entry((folder / meta["bin"]).read_bytes())[1]
    # the entry as a process before an update wrote it: one variant traced a function whose source
    # was other then (another checksum recorded for it)
    entry = held()
    vkey, blob = next((k, b) for k, bs in entry.items() for b in bs)
    fn = variants._deserialize(blob)
    src = min(fn._artifacts.source_info.inlined_sources, key=lambda s: (s.module, s.firstlineno))
    fn._artifacts.source_info.inlined_sources = (fn._artifacts.source_info.inlined_sources - {src}) | {
        dataclasses.replace(src, checksum="0" * 64)}
    stale = variants.serialize(fn)
    entry[vkey] = [stale if b == blob else b for b in entry[vkey]]
    meta = json.loads((folder / f"{key}.json").read_text())
    data = C.pack_entry(C.unpack_entry((folder / meta["bin"]).read_bytes())[0], entry)
    (folder / meta["bin"]).write_bytes(data)
    meta.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    (folder / f"{key}.json").write_text(json.dumps(meta))

    def restart():
        monkeypatch.setattr(C.entry, "_loaded", set())
        restarted = variants.Variants()
        monkeypatch.setattr(process_scheduler(), "variants", restarted)
        unet = tiny_unet(seed=2)
        api.compile_unet(unet, "inductor", dynamic_shapes=False)
        api.warmup(unet, "1x64x64", context_tokens=6)
        return restarted
    once = restart()
    assert once.unusable == 1 and once.compiled == 1, vars(once)
    third = tiny_unet(seed=3)                    # another instance in that process: nothing to save again
    api.compile_unet(third, "inductor", dynamic_shapes=False)
    api.warmup(third, "1x64x64", context_tokens=6)
    assert api.accelerator_of(third).cache.saved_mib is None
    kept = [b for bs in held().values() for b in bs]
    assert stale not in kept and len(kept) == sum(map(len, entry.values())), "left out, its fresh one kept"
    again = restart()
    assert again.unusable == 0 and again.compiled == 0, vars(again)
