"""compiler/report.py: the structured reason, the report text and the facts the UI and /history get."""
from __future__ import annotations

import pytest

from unet_compiler.compiler.reasons import DISABLE_ENV, Reason, runtime_fallback
from unet_compiler.compiler.report import Report, compile_facts, status_line, warmup_facts


def test_reason_is_the_sentence_and_its_parts():
    import pickle

    r = Reason("no GPU", "buy one", "triton")
    assert r == "triton: no GPU. Fix: buy one" and (r.what, r.why, r.fix, r.cause) == ("triton", "no GPU", "buy one",
                                                                                    "triton: no GPU")
    assert pickle.loads(pickle.dumps(r)).fix == "buy one" and pickle.loads(pickle.dumps(r)) == r
    said = Reason("no C++ compiler", "install gcc, then restart ComfyUI", text="no C++ compiler; install gcc")
    assert said.about("inductor") == "inductor: no C++ compiler; install gcc" and said.about("inductor").fix == said.fix
    # a plain sentence (a backend outside the package) is read into the same parts
    legacy = Reason.of("inductor: no C++ compiler (g++) found; install gcc (Linux)")
    assert (legacy.what, legacy.why, legacy.fix) == ("inductor", "no C++ compiler (g++) found",
                                                     "install gcc (Linux), then restart ComfyUI")
    assert Reason.of("ipex: not installed").fix == "" and Reason.of("torch is old. Fix: upgrade.").fix == "upgrade"


def _report(**kw) -> Report:
    base = dict(backend_requested="auto", backend="inductor", family="sd15", regions={"resblock": 22})
    return Report(**{**base, **kw})


def test_compiled_state_and_its_status_line(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    facts = compile_facts(_report())
    assert facts["state"] == "planned" and facts["reason"] == facts["fix"] == ""
    assert status_line(facts).startswith("inductor: planned, 22 regions; compiled code runs after Warmup Shapes")


@pytest.mark.parametrize("kw, state, reason_has, fix_has", [
    (dict(backend_requested="triton", why=[Reason("no CUDA device", "run on a GPU", "triton")]),
     "fallback", "triton: no CUDA device", "run on a GPU"),
    (dict(backend_requested="eager", backend="eager", regions={}), "eager", "chosen in Select Backend",
     "choose auto"),
    (dict(regions={}, skipped=[("attention", 16, "masked")]), "fallback", "attention x16: masked",
     "none needed for correctness"),
])
def test_fallback_and_eager_states_name_reason_and_fix(monkeypatch, kw, state, reason_has, fix_has):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    facts = compile_facts(_report(**kw))
    assert facts["state"] == state and reason_has in facts["reason"] and fix_has in facts["fix"], facts
    line = status_line(facts)
    assert reason_has in line and fix_has in line and "\n" not in line


def test_off_switch_is_the_reason(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")
    facts = compile_facts(_report())
    assert facts["state"] == "eager" and DISABLE_ENV in facts["reason"] and f"unset {DISABLE_ENV}" in facts["fix"]


def test_warmup_and_runtime_fallbacks():
    assert warmup_facts(_report(), "inductor", {})["state"] == "compiled"
    w = warmup_facts(_report(), "inductor", {"attention": "RuntimeError: boom"})
    assert w["state"] == "fallback" and "attention regions failed (RuntimeError: boom)" in w["reason"]
    r = runtime_fallback("triton", "resblock", "ValueError: x")
    assert r.what == "triton" and r.startswith("triton: fallback: resblock regions failed") and DISABLE_ENV in r.fix


def test_report_text_says_what_ran():
    rep = _report(notes=["a note"], warmup=[("2x64x64", 3.25, 4)], from_cache={"2x64x64": 4}, max_abs_diff=1e-5,
                  diff_label="at 2x64x64")
    text = rep.text({"calls": 3, "graphs_compiled": 4, "graphs_from_cache": 4, "recompiles_after_warmup": 0})
    assert text.splitlines()[0] == ("UNet Compiler: backend inductor (asked auto), sd15 UNet, precision auto, "
                                     "dynamic shapes on")
    for part in ("accelerated regions: resblock x22", "note: a note", "warmed 2x64x64: 3.2 s, 0 graph(s) compiled, "
                 "4 loaded from the compile cache", "graphs compiled: 0; loaded from the compile cache: 4", "max |compiled - eager| at 2x64x64: 1e-05", "recompiles after warmup: 0"):
        assert part in text, text
    assert "dynamic shapes on, static first (a warmup of one shape)" in _report(dynamic_shapes=None).text()


def test_a_warmup_in_which_nothing_ran_compiled_is_no_compiled_state():
    rep = Report(backend_requested="auto", backend="inductor", regions={"resblock": 10})
    assert warmup_facts(rep, "inductor", {}, (10, 10))["state"] == "compiled"
    why = Reason("fp8 matmul (weight_dtype fp8_e4m3fn_fast): ComfyUI's scaled fp8 matmul runs it",
                 "load with weight_dtype fp8_e4m3fn")
    cast = warmup_facts(rep, "inductor", {}, (0, 10), cast_eager={"resblock": why, "attention": why})
    assert cast["state"] == "fallback" and cast["reason"] == (
        "0 of 10 regions ran compiled code: ComfyUI casts their weights on every call, and " + why.why)
    assert cast["fix"] == "load with weight_dtype fp8_e4m3fn"
    other = warmup_facts(rep, "inductor", {}, (0, 10))
    assert other["state"] == "fallback" and "masks, attention overrides or patches" in other["reason"]


def test_a_recompile_at_half_a_warmed_batch_names_the_cond_uncond_split():
    """Hook LoRA (or cfg 1) makes ComfyUI call cond and uncond apart: half the warmed batch. The fix
    says so; another shape outside the range does not get that sentence."""
    from unet_compiler.compiler.lifecycle.recompiles import recompile_sentence
    e = dict(prompt="p1", shape="1x64x64", graphs=3, seconds=2.0, guards=["batch"])
    text = recompile_sentence(e, ["2x64x64"])
    assert "Fix: add 1x64x64 to Warmup Shapes" in text and "cond and uncond apart" in text and "hook LoRA" in text
    other = recompile_sentence(dict(e, shape="1x128x128"), ["2x64x64"])
    assert "Fix: add 1x128x128 to Warmup Shapes" in other and "cond and uncond" not in other


def test_a_recompile_the_node_cannot_warm_says_so():
    """A call Warmup Shapes would refuse as an entry (a crop under 64 px from area conditioning, a
    batch over 64) is not told to add itself; a prompt length is told to warm ``context_tokens``; a
    model warmed at more shapes than one warmup takes still knows which are inside, and the line
    names only the first few."""
    from unet_compiler.compiler.lifecycle.recompiles import recompile_sentence
    e = dict(prompt="p1", shape="1x32x32", graphs=2, seconds=1.0, guards=["x"])
    crop = recompile_sentence(e, ["2x64x64", "2x128x128"])
    assert "add 1x32x32" not in crop and "Warmup Shapes cannot warm a 1x32x32 call (width 32 must be" in crop, crop
    assert "area or mask conditioning" in crop
    batch = recompile_sentence(dict(e, shape="130x64x64"), ["2x64x64"])
    assert "cannot warm a 130x64x64 call (batch 130 must be between 1 and 64)" in batch and "area" not in batch
    prompt = recompile_sentence(dict(e, shape="2x64x64", tokens=154), ["2x64x64"])
    assert "(a 154-token prompt, a length the code was not compiled for)" in prompt, prompt
    assert "Fix: set Warmup Shapes' context_tokens to 154, or list two shapes" in prompt, prompt
    assert "inside the warmed range" not in prompt
    ranged = recompile_sentence(dict(e, shape="2x64x64", tokens=154), ["2x64x64", "2x128x128"])
    assert "context_tokens to 154; the new code" in ranged, ranged
    many = [f"2x{64 + 8 * i}x{64 + 8 * i}" for i in range(40)]
    inside = recompile_sentence(dict(e, shape="2x96x96"), many)
    assert "(inside the warmed range" in inside and "add 2x96x96" not in inside, inside
    assert "2x120x120 and 32 more; why" in inside and "2x128x128" not in inside, inside


def test_a_prompt_length_is_read_from_the_text_inputs_guard():
    from unet_compiler.compiler.compat.dynamo import prompt_tokens
    ctx = "0/1: tensor 'L['context']' size mismatch at index 1. expected 77, actual 154"
    assert prompt_tokens([ctx]) == 154
    assert prompt_tokens(["0/1: tensor 'L['txt']' size mismatch at index 1. expected 256, actual 512"]) == 512
    assert prompt_tokens(["0/1: tensor 'L['x']' size mismatch at index 1. expected 77, actual 154"]) is None
    assert prompt_tokens(["0/1: tensor 'L['context']' size mismatch at index 0. expected 2, actual 1"]) is None


def test_another_packs_classes_are_named_by_their_pack_folder():
    """ComfyUI imports a custom node pack as a module named by its folder's path; the report names its
    classes from the pack's folder on (POSIX and Windows paths), other classes as they are."""
    import torch

    from unet_compiler.compiler.compat.comfy import class_name
    posix = type("VanillaTemporalModule", (), {"__module__": "/srv/ComfyUI/custom_nodes/ComfyUI-AnimateDiff-Evolved"
                                                             ".animatediff.motion_module_ad"})
    windows = type("Linear", (), {"__module__": "C:\\ComfyUI_windows_portable\\ComfyUI\\custom_nodes\\ComfyUI-GGUF.ops"})
    assert class_name(posix) == "ComfyUI-AnimateDiff-Evolved.animatediff.motion_module_ad.VanillaTemporalModule"
    assert class_name(windows) == "ComfyUI-GGUF.ops.Linear"
    assert class_name(torch.nn.Linear) == "torch.nn.modules.linear.Linear"
