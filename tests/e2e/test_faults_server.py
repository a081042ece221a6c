"""Faults, injected into a real ComfyUI server (issue 11, item 2): each ends in a visible fallback
(the node's report or the prompt's /history says what fell back and why) or a clean cancel, and
every prompt that completes gives plain ComfyUI's latent (``MAX_LATENT_REL_L2``, the parity tests').

How faults get in, without test hooks in the pack:

- In the running server: the test-only node ``UNetCompilerTest_InjectFault``
  (tests/e2e/comfy_test_node/faults.py), placed before Compile UNet, replaces what the pack calls
  (a backend's region implementations, the compile cache's load, ComfyUI's model load) for the
  prompt it runs in only: every patch is undone when that prompt ends (and checked gone by the last
  test here). One server runs all of these.
- In the environment: the first server's ``UNET_COMPILER_CACHE_DIR`` lies under a regular file
  (unwritable, even for root).
- At import time (triton, IPEX): a second server whose PYTHONPATH starts with a stand-in ``triton``
  whose import raises ImportError and a stand-in IPEX 2.8.0 whose import kills the process (as the
  real one does beside another torch).

Cancel is ComfyUI's own POST /interrupt while the prompt runs: during Warmup Shapes' first (real)
inductor compile, and during sampling. The workflow is the smallest: 64 px, 2 steps, cfg 1 (UNet
batch 1), one warmup shape; the first server compiles once (~1-2 min on 2 cores) and every later
prompt reuses those graphs; the second server reuses inductor's on-disk cache of the first.
"""
from __future__ import annotations

import importlib.util
import json
import os
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from unet_compiler.bench import comfy_server as S

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_e2e_parity", _HERE / "test_comfyui_server.py")
_parity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_parity)
MAX_LATENT_REL_L2 = _parity.MAX_LATENT_REL_L2
relative_l2, the_latent, txt2img_prompt, ui_text = (_parity.relative_l2, _parity.the_latent,
                                                     _parity.txt2img_prompt, _parity.ui_text)

pytestmark = pytest.mark.e2e

TEST_NODE = _HERE / "comfy_test_node"
SIZE, STEPS = 64, 2
WARMUP = f"1x{SIZE}x{SIZE}"   # cfg 1: one UNet batch of 1
LORA_STRENGTHS = (0.5, 1.0)


# ---- workflows -------------------------------------------------------------------------------------
def workflow(ckpt: str, prefix: str, *, fault=None, compiled=True, lora=None, backend=None, after=None) -> dict:
    """txt2img at 64 px, 2 steps, cfg 1: [InjectFault] -> [Select Backend] Compile UNet -> Warmup Shapes
    -> [LoraLoaderModelOnly] -> [InjectFault ``after``] -> KSampler. ``fault`` / ``after``: dicts of the
    fault node's inputs."""
    p = txt2img_prompt(ckpt, prefix + "_" + uuid.uuid4().hex[:8])
    p["5"]["inputs"].update(cfg=1.0, steps=STEPS)
    model = ["1", 0]
    if fault is not None:
        p["20"] = {"class_type": "UNetCompilerTest_InjectFault",
                   "inputs": {"model": model, "region": "resblock", **fault}}
        model = ["20", 0]
    if compiled:
        p["11"] = {"class_type": "UNetCompiler_CompileUNet", "inputs": {"model": model}}
        if backend is not None:
            p["10"] = {"class_type": "UNetCompiler_SelectBackend",
                       "inputs": {"backend": backend, "precision": "auto", "dynamic_shapes": True,
                                  "cuda_graphs": False}}
            p["11"]["inputs"]["backend"] = ["10", 0]
        p["12"] = {"class_type": "UNetCompiler_WarmupShapes",
                   "inputs": {"model": ["11", 0], "shapes": WARMUP, "context_tokens": 77, "background": False}}
        model = ["12", 0]
    if lora is not None:
        p["30"] = {"class_type": "LoraLoaderModelOnly",
                   "inputs": {"model": model, "lora_name": lora[0], "strength_model": lora[1]}}
        model = ["30", 0]
    if after is not None:
        p["21"] = {"class_type": "UNetCompilerTest_InjectFault",
                   "inputs": {"model": model, "region": "resblock", **after}}
        model = ["21", 0]
    p["5"]["inputs"]["model"] = model
    return p


def queue(server, prompt) -> str:
    resp = server.post_json("/prompt", {"prompt": prompt, "client_id": server.client_id})
    assert not resp.get("node_errors") and not resp.get("error"), resp
    return resp["prompt_id"]


def wait(server, prompt_id, timeout=900.0) -> dict:
    """The prompt's /history entry once it ended, whatever its status."""
    deadline = time.time() + timeout
    while True:
        try:
            entry = server.get_json(f"/history/{prompt_id}", timeout=120).get(prompt_id)
        except (TimeoutError, OSError):   # a server busy compiling on 2 loaded cores answers late
            entry = None
        if entry is not None and (entry.get("status") or {}).get("status_str") in ("success", "error"):
            return entry
        server.check_alive()
        assert time.time() < deadline, f"prompt {prompt_id} did not end in {timeout:.0f} s:\n{server.log_tail()}"
        time.sleep(0.3)


def messages(entry, name=None) -> list:
    msgs = (entry.get("status") or {}).get("messages") or []
    return [d for n, d in msgs if n == name] if name else [n for n, _ in msgs]


def succeeded(server, entry) -> dict:
    status = entry.get("status") or {}
    if status.get("status_str") != "success":
        raise S.PromptFailed(f"prompt failed: {json.dumps(status)[:3000]}\nlog tail:\n{server.log_tail(6000)}")
    return entry


def run(server, prompt, timeout=900.0) -> dict:
    return succeeded(server, wait(server, queue(server, prompt), timeout))


def assert_eager_latent(server, entry, reference, what: str):
    rel = relative_l2(the_latent(server, entry), reference)
    print(f"\n[faults] {what}: latent relative L2 vs eager {rel:.2e}")
    assert np.isfinite(the_latent(server, entry)).all(), f"{what}: latent not finite"
    assert rel <= MAX_LATENT_REL_L2, f"{what}: latent relative L2 {rel:.2e} > {MAX_LATENT_REL_L2:.0e} from eager"


def post(server, route: str, payload: dict) -> None:
    """POST a JSON body to a route that answers with no body (/interrupt, /free); any status but
    success raises (``ComfyServer.post_json``)."""
    assert server.post_json(route, payload) is None, route


def free(server, flags: dict) -> None:
    """POST /free, then one tiny prompt: ComfyUI's worker applies the flags right after a prompt ends
    (before it takes the next), so whatever is queued after that prompt's end runs after them."""
    post(server, "/free", flags)
    run(server, {"1": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
                 "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0], "filename_prefix": "free"}}}, 120)


def wait_for(predicate, timeout: float, what: str, server):
    deadline = time.time() + timeout
    while not predicate():
        server.check_alive()
        assert time.time() < deadline, f"{what} did not happen in {timeout:.0f} s; log tail:\n{server.log_tail()}"
        time.sleep(0.1)


def interrupted_at(entry) -> str | None:
    """The node a cancelled prompt stopped in (None: it was not cancelled)."""
    got = messages(entry, "execution_interrupted")
    return str(got[0].get("node_id")) if got else None


# ---- the fault server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory) -> Path:
    """Inductor's on-disk cache, shared by this module's servers (the second compiles from it)."""
    return tmp_path_factory.mktemp("faults_inductor_cache")


@pytest.fixture(scope="module")
def fault_server(comfyui_path, sd15_checkpoint, patch_asset_files, inductor_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults_server")
    (root / "a_file").write_text("the compile cache folder would be under this file\n")
    server = S.start_server(root / "comfy", sd15_checkpoint.parent,
                            extra_nodes={"unet_compiler_test_node": TEST_NODE}, comfyui_path=comfyui_path,
                            env={"UNET_COMPILER_CACHE": "on",   # tests/conftest.py turns it off for the session
                                 "UNET_COMPILER_CACHE_DIR": str(root / "a_file" / "compile_cache"),
                                 "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)},
                            log=lambda m: print("\n[faults] " + m))
    try:
        for path in patch_asset_files.values():
            S.link(server.model_dirs["loras"] / path.name, path)
        server.assets = {k: p.name for k, p in patch_asset_files.items()}
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def eager(fault_server, sd15_checkpoint):
    """Plain ComfyUI's latents (no pack node): ``eager[None]`` without a LoRA, ``eager[s]`` with the
    LoRA at strength s. Computed on first use."""
    class Latents(dict):
        def __missing__(self, strength):
            lora = None if strength is None else (fault_server.assets["lora"], strength)
            entry = run(fault_server, workflow(sd15_checkpoint.name, "eager", compiled=False, lora=lora), 300)
            self[strength] = the_latent(fault_server, entry)
            return self[strength]
    return Latents()


@pytest.fixture(scope="module")
def first_compile(fault_server, sd15_checkpoint, eager):
    """The server's first compiled prompt, cancelled with POST /interrupt while Warmup Shapes runs its
    first inductor compile, then queued again: (the cancelled entry, the completed one)."""
    ref = eager[None]  # the eager reference runs before anything compiles
    assert ref is not None
    prompt = workflow(sd15_checkpoint.name, "first")
    mark = f"Warmup Shapes (node 12): inductor: compiling 1 shape(s): {WARMUP}"
    t0 = time.time()
    pid = queue(fault_server, prompt)
    wait_for(lambda: mark in fault_server.log_tail(200_000), 300, "Warmup Shapes starting to compile", fault_server)
    time.sleep(3.0)   # inside the compile (it takes a minute or more here)
    post(fault_server, "/interrupt", {})
    cancelled = wait(fault_server, pid)
    t1 = time.time()
    done = run(fault_server, prompt)
    print(f"\n[faults] first compile: cancelled after {t1 - t0:.1f} s, then completed in {time.time() - t1:.1f} s")
    return cancelled, done


def test_unwritable_cache_folder_is_said_and_harmless(first_compile):
    """This server's compile cache folder lies under a regular file (unwritable, even for root): the
    first compile cannot save it, Warmup Shapes' report says where, why and the fix, and the image is
    the eager one (the next test checks that prompt's latent)."""
    report = ui_text(first_compile[1], "12")
    assert "compile cache: not saved:" in report and "a_file/compile_cache is not writable (Not a directory)" in report, \
        report
    assert "Fix: set UNET_COMPILER_CACHE_DIR to a writable folder" in report, report


def test_cancel_during_warmup_then_the_model_still_works(fault_server, first_compile, eager):
    """Cancel during Warmup Shapes' compile: the prompt ends as interrupted there, the server stays
    up, and the same prompt queued again (ComfyUI reuses the Compile UNet output: the very
    accelerator that was interrupted) warms up, compiles the rest and gives the eager latent, with
    no region turned off."""
    cancelled, done = first_compile
    assert interrupted_at(cancelled) == "12", (
        f"expected the prompt interrupted in Warmup Shapes, got status {json.dumps(cancelled.get('status'))[:2000]}")
    assert "execution_error" not in messages(cancelled), messages(cancelled)
    fault_server.check_alive()
    assert "11" in sum((d.get("nodes", []) for d in messages(done, "execution_cached")), []), \
        "Compile UNet ran again: the interrupted accelerator was not the one reused"
    report = ui_text(done, "12")
    assert "inductor: compiled" in report and "failed" not in report, report
    assert not messages(done, "unet_compiler.fallback"), messages(done, "unet_compiler.fallback")
    assert_eager_latent(fault_server, done, eager[None], "after a cancelled warmup")


# ---- compile and run-time faults in one region -------------------------------------------------------
def test_compile_error_in_one_region_falls_back_visibly(fault_server, sd15_checkpoint, first_compile, eager):
    """The resblock regions' compile raises inside dynamo (BackendCompilerFailed) during Warmup Shapes:
    they run ComfyUI's own code, the other regions stay compiled, and the report says which and why."""
    entry = run(fault_server, workflow(sd15_checkpoint.name, "compile_error", fault={"fault": "compile_error"}))
    report = ui_text(entry, "12")
    assert "inductor: fallback" in report and "resblock regions failed (BackendCompilerFailed" in report, report
    assert "injected compile error" in report, report
    assert "attention" not in report.split("status:")[-1], report   # only the resblocks fell back
    assert_eager_latent(fault_server, entry, eager[None], "compile error in the resblocks")


@pytest.mark.parametrize("fault,region,error", [
    ("kernel_error", "attention", "RuntimeError: injected kernel error"),
], ids=["kernel-error"])
def test_run_time_fault_in_one_region_falls_back_and_reaches_history(fault_server, sd15_checkpoint, first_compile,
                                                                      eager, fault, region, error):
    """A region kind's compiled code raises during sampling (a kernel error; an out-of-memory error):
    that call and the kind's later ones run ComfyUI's own code, and the prompt's /history says what
    fell back, why and the fix (no pack node runs during sampling to say it)."""
    entry = run(fault_server, workflow(sd15_checkpoint.name, fault, fault={"fault": fault, "region": region}))
    assert "fallback" not in ui_text(entry, "12"), "the fault hit during warmup, not sampling"
    events = messages(entry, "unet_compiler.fallback")
    assert len(events) == 1, messages(entry)
    ev = events[0]
    assert ev["kind"] == region and ev["backend"] == "inductor" and ev["state"] == "fallback", ev
    assert error in ev["reason"] and ev["fix"], ev
    assert f"{region} regions failed ({error}" in ev["text"] and "run the model's own code now" in ev["text"], ev["text"]
    assert ev["node_ids"] == ["11", "12"], ev
    assert_eager_latent(fault_server, entry, eager[None], f"{fault} in the {region} regions")


def test_out_of_memory_during_sampling_costs_those_calls_only(fault_server, sd15_checkpoint, first_compile, eager):
    """A region kind's compiled code runs out of memory during sampling (a transient OOM on a small
    card): those calls run ComfyUI's own code and the image is eager's, and the kind is not turned
    off: no fallback event, nothing in /history says the model fell back."""
    entry = run(fault_server, workflow(sd15_checkpoint.name, "oom", fault={"fault": "oom", "region": "feedforward"}))
    assert "fallback" not in ui_text(entry, "12"), "the fault hit during warmup, not sampling"
    assert not messages(entry, "unet_compiler.fallback"), messages(entry, "unet_compiler.fallback")
    assert_eager_latent(fault_server, entry, eager[None], "out of memory in the feedforward regions")


def test_cancel_during_sampling_leaves_the_model_working(fault_server, sd15_checkpoint, first_compile, eager,
                                                         tmp_path):
    """Cancel while KSampler runs, noticed inside an accelerated region (where ComfyUI's eager ops
    check it): the prompt ends as interrupted in KSampler, nothing falls back; queued again, the same
    compiled model samples to the eager latent."""
    marker = tmp_path / "sampling_started"
    prompt = workflow(sd15_checkpoint.name, "cancel_sampling",
                      fault={"fault": "slow_sampling", "marker": str(marker)})
    pid = queue(fault_server, prompt)
    wait_for(marker.exists, 600, "sampling", fault_server)
    post(fault_server, "/interrupt", {})
    cancelled = wait(fault_server, pid)
    assert interrupted_at(cancelled) == "5", json.dumps(cancelled.get("status"))[:2000]
    assert not messages(cancelled, "unet_compiler.fallback"), "a cancel was taken for a region failure"
    assert "fallback" not in ui_text(cancelled, "12"), ui_text(cancelled, "12")
    again = run(fault_server, prompt)
    cached = sum((d.get("nodes", []) for d in messages(again, "execution_cached")), [])
    assert {"11", "12"} <= set(cached), f"not the same compiled model: cached {cached}"
    assert not messages(again, "unet_compiler.fallback"), messages(again, "unet_compiler.fallback")
    assert_eager_latent(fault_server, again, eager[None], "after a cancelled sampling")


# ---- the compile cache ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault,said", [
    ("cache_corrupt", "compile cache: miss (entry discarded: sha256 mismatch (corrupt)"),
    ("cache_vouched_garbage", "compile cache: miss (torch could not load the entry"),
], ids=["corrupt", "vouched-garbage"])
def test_corrupt_cache_entry_is_discarded(fault_server, sd15_checkpoint, first_compile, eager, fault, said,
                                         tmp_path):
    """The cache folder holds garbage under this model's entry (its .json not matching it; or vouching
    for it, so it reaches torch's loader): the entry is discarded with one line in the report, the
    files are gone, and the model compiles and samples as usual."""
    folder = tmp_path / "compile_cache"
    entry = run(fault_server, workflow(sd15_checkpoint.name, fault, fault={"fault": fault, "marker": str(folder)}))
    report = ui_text(entry, "11")
    assert str(folder) in report and said in report, report
    assert not list(folder.glob("*.bin")) and not list(folder.glob("*.json")), "the garbage entry was left in place"
    assert_eager_latent(fault_server, entry, eager[None], fault)


# ---- LoRA, unload / reload, offload ----------------------------------------------------------------------
def test_two_loras_queued_back_to_back_on_one_compiled_model(fault_server, sd15_checkpoint, first_compile, eager):
    """Two prompts posted together, the LoRA at two strengths after the same Compile UNet + Warmup
    Shapes: each gives plain ComfyUI's latent at its own strength."""
    lora = fault_server.assets["lora"]
    refs = {s: eager[s] for s in LORA_STRENGTHS}
    assert relative_l2(refs[0.5], refs[1.0]) > 10 * MAX_LATENT_REL_L2, "the strengths give the same image"
    pids = {s: queue(fault_server, workflow(sd15_checkpoint.name, f"lora{s}", lora=(lora, s))) for s in LORA_STRENGTHS}
    for s, pid in pids.items():
        entry = succeeded(fault_server, wait(fault_server, pid))
        cached = sum((d.get("nodes", []) for d in messages(entry, "execution_cached")), [])
        if s == LORA_STRENGTHS[1]:
            assert "12" in cached, f"strength {s}: not the first prompt's compiled model (cached {cached})"
        assert not messages(entry, "unet_compiler.fallback"), messages(entry, "unet_compiler.fallback")
        assert_eager_latent(fault_server, entry, refs[s], f"LoRA {s}, queued back to back")


def test_unload_and_reload_between_prompts(fault_server, sd15_checkpoint, first_compile, eager):
    """ComfyUI unloads the model between prompts (POST /free, what it does under memory pressure):
    the compiled model with its LoRA, reloaded and re-patched (new weight storage), gives the eager
    latent; and after ``free_memory`` (caches dropped: the checkpoint is loaded from disk again, a
    new model compiled) it does too."""
    lora = (fault_server.assets["lora"], 1.0)
    ref = eager[1.0]

    def again(nonce):
        return workflow(sd15_checkpoint.name, "reload", lora=lora, after={"fault": "none", "nonce": nonce})
    run(fault_server, again("before"))
    log_at = len(fault_server.log_tail(10_000_000))
    post(fault_server, "/free", {"unload_models": True})   # not free(): its prompt would evict node 12's output
    time.sleep(1.0)
    entry = run(fault_server, again("after-unload"))
    reloaded = fault_server.log_tail(10_000_000)[log_at:]
    assert "Requested to load BaseModel" in reloaded, "the model was not unloaded and loaded again"
    assert "12" in sum((d.get("nodes", []) for d in messages(entry, "execution_cached")), [])
    assert_eager_latent(fault_server, entry, ref, "LoRA 1.0 after an unload")

    free(fault_server, {"unload_models": True, "free_memory": True})
    entry = run(fault_server, again("after-free"))
    cached = sum((d.get("nodes", []) for d in messages(entry, "execution_cached")), [])
    assert "1" not in cached and "11" not in cached, f"caches were not dropped (cached {cached})"
    assert "inductor: compiled" in ui_text(entry, "12"), ui_text(entry, "12")
    assert_eager_latent(fault_server, entry, ref, "LoRA 1.0 after free_memory (reloaded from disk, recompiled)")


def test_lowvram_offload(fault_server, sd15_checkpoint, first_compile, eager):
    """ComfyUI loads the model partially (most weights cast per call, as --lowvram / --novram do on a
    GPU; on --cpu those flags change nothing): the regions whose weights ComfyUI casts run compiled
    code on ComfyUI's own cast, none runs the model's code, and the latent is the eager one."""
    entry = run(fault_server, workflow(sd15_checkpoint.name, "lowvram",
                                       fault={"fault": "lowvram", "nonce": uuid.uuid4().hex}))
    report = ui_text(entry, "12")
    assert "region calls on the model's own code for patches/lowvram: 0" in report, report
    assert "compiled with ComfyUI's cast outside the graph" in report, report
    assert "failed" not in report, report
    assert_eager_latent(fault_server, entry, eager[None], "lowvram offload")


def test_no_fault_outlives_its_prompt(fault_server, sd15_checkpoint, first_compile, eager):
    """Last: a new model compiled after all of the above has no fault in it (nothing fell back, the
    cache entry is read, the model loads fully) and gives the eager latent."""
    entry = run(fault_server, workflow(sd15_checkpoint.name, "clean", fault={"fault": "none", "nonce": "last"}))
    report = ui_text(entry, "12")
    assert "inductor: compiled" in report and "failed" not in report, report
    assert "region calls on the model's own code for patches/lowvram: 0" in report, report
    assert not messages(entry, "unet_compiler.fallback"), messages(entry, "unet_compiler.fallback")
    assert "discarded" not in ui_text(entry, "11") and "could not load" not in ui_text(entry, "11"), ui_text(entry, "11")
    assert_eager_latent(fault_server, entry, eager[None], "after every fault")


# ---- import-time and environment faults: a second server ----------------------------------------------------
FAKE_TRITON = '''import os
open(os.environ["UNET_COMPILER_TEST_TRITON_MARKER"], "a").write("imported\\n")
raise ImportError("injected: libtriton.so: undefined symbol: _ZN4mlir (triton does not match this torch)")
'''
#: what IPEX 2.8.0's __init__ does beside another torch: it prints an error and calls os.exit(127), which
#: does not exist, so the import raises AttributeError (ComfyUI's model_management imports IPEX itself at
#: start, inside a bare except: that is the one import the marker may show)
FAKE_IPEX = '''import os
open(os.environ["UNET_COMPILER_TEST_IPEX_MARKER"], "a").write("imported\\n")
print("ERROR! Intel(R) Extension for PyTorch* needs to work with PyTorch 2.8.*, but PyTorch 2.13.0 is found.")
os.exit(127)
'''


@pytest.fixture(scope="module")
def broken_env_server(comfyui_path, sd15_checkpoint, inductor_cache, tmp_path_factory, request):
    """A server whose ``triton`` cannot be imported, beside a mismatched IPEX 2.8.0 (its import raises)."""
    request.getfixturevalue("first_compile")   # after the first server compiled: its inductor cache is warm
    request.getfixturevalue("fault_server").stop()   # its tests ran (they come first): two servers beside the
    #                                                  session's would not fit in 24 GB
    root = tmp_path_factory.mktemp("faults_broken_env")
    site = root / "site"
    (site / "triton").mkdir(parents=True)
    (site / "triton" / "__init__.py").write_text(FAKE_TRITON)
    (site / "intel_extension_for_pytorch").mkdir()
    (site / "intel_extension_for_pytorch" / "__init__.py").write_text(FAKE_IPEX)
    meta = site / "intel_extension_for_pytorch-2.8.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: intel_extension_for_pytorch\nVersion: 2.8.0\n")
    marker, ipex_marker = root / "triton_imports", root / "ipex_imports"
    server = S.start_server(root / "comfy", sd15_checkpoint.parent, comfyui_path=comfyui_path,
                            env={"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
                                 "UNET_COMPILER_TEST_TRITON_MARKER": str(marker),
                                 "UNET_COMPILER_TEST_IPEX_MARKER": str(ipex_marker),
                                 "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)},
                            log=lambda m: print("\n[faults] " + m))
    server.triton_marker, server.ipex_marker = marker, ipex_marker
    # ComfyUI's model_management imports IPEX itself while starting (inside a bare except)
    server.ipex_imports_at_start = ipex_marker.read_text().count("imported") if ipex_marker.exists() else 0
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def broken_env_runs(broken_env_server, sd15_checkpoint):
    """Plain ComfyUI's latent there, then Select Backend ipex (the server's first compile), then triton."""
    s = broken_env_server
    eager_latent = the_latent(s, run(s, workflow(sd15_checkpoint.name, "eager", compiled=False), 300))
    t0 = time.time()
    ipex = run(s, workflow(sd15_checkpoint.name, "ipex", backend="ipex"))
    t1 = time.time()
    triton = run(s, workflow(sd15_checkpoint.name, "triton", backend="triton"))
    print(f"\n[faults] broken env: ipex prompt (first compile) {t1 - t0:.1f} s, triton prompt {time.time() - t1:.1f} s")
    return eager_latent, ipex, triton


def test_the_pack_loads_without_triton_and_beside_a_mismatched_ipex(broken_env_server, broken_env_runs):
    s = broken_env_server
    info = s.object_info()
    assert {"UNetCompiler_CompileUNet", "UNetCompiler_WarmupShapes"} <= set(info), s.pack_import_report()
    assert "Cannot import" not in s.pack_import_report(), s.pack_import_report()
    assert s.triton_marker.is_file(), "nothing tried to import the stand-in triton: the fault was not live"
    assert s.ipex_marker.read_text().count("imported") == s.ipex_imports_at_start, \
        "the mismatched IPEX was imported after ComfyUI started: the pack imported it"


def test_mismatched_ipex_falls_back_visibly(broken_env_server, broken_env_runs):
    eager_latent, entry, _ = broken_env_runs
    report = ui_text(entry, "11")
    assert "backend inductor (asked ipex)" in report, report
    assert "IPEX 2.8.0 only works with torch 2.8.x" in report and "Fix: pip install torch==2.8" in report, report
    assert "inductor: fallback (asked ipex)" in report, report
    assert_eager_latent(broken_env_server, entry, eager_latent, "ipex asked beside a mismatched IPEX")


def test_triton_requested_without_triton_falls_back_visibly(broken_env_server, broken_env_runs):
    eager_latent, _, entry = broken_env_runs
    report = ui_text(entry, "11")
    assert "backend inductor (asked triton)" in report and "inductor: fallback (asked triton)" in report, report
    assert "(asked triton): triton: " in report, report   # the triton backend's own reason
    assert_eager_latent(broken_env_server, entry, eager_latent, "triton asked with an unimportable triton")

