"""Why dynamo compiled again: the guard that failed, from torch's own record, in plain words.

Dynamo appends one reason string per failed guard check to ``torch._dynamo.utils.guard_failures``
(``{code: [reason, ...]}``, on by default: ``torch._dynamo.config.report_guard_failures``). A
recompile's reasons are the strings appended while the call ran."""
from __future__ import annotations

import re


def _failures() -> dict:
    try:
        from torch._dynamo.utils import guard_failures
    except Exception:  # a torch without it: recompiles are still counted, just not explained
        return {}
    return guard_failures


def guard_marks(extra: list) -> dict:
    """A bookmark in dynamo's guard-failure record (cheap: one length per compiled code object) and
    in ``extra`` (another list of failures worded as dynamo's guards: the precompiled regions' misses)."""
    marks = {code: len(reasons) for code, reasons in list(_failures().items())}
    marks["extra"] = len(extra)
    return marks


def guard_reasons_since(marks: dict, extra: list) -> list[str]:
    """The raw reasons recorded after ``marks`` (dynamo's, then ``extra``'s), oldest first, each once."""
    out = []
    for code, reasons in [*_failures().items(), ("extra", extra)]:
        for r in reasons[marks.get(code, 0):]:
            r = str(r).split("\nUser stack trace:", 1)[0]
            if r not in out:
                out.append(r)
    return out


_SIZE = re.compile(r"tensor '(?P<name>.+?)' size mismatch at index (?P<dim>\d+)\. expected (?P<exp>\d+), "
                   r"actual (?P<act>\d+)")
_DTYPE = re.compile(r"tensor '(?P<name>.+?)' dtype mismatch\. expected (?P<exp>\w+), actual (?P<act>\w+)")
_SYM = re.compile(r"(?P<name>L\['[^']+'\](?:\.\w+)*|[A-Za-z_][\w.]*)\.size\(\)\[(?P<dim>\d+)\]")
_NAME = re.compile(r"^L\['(?P<n>[^']+)'\]")
#: a region input's dims in the model's language: a UNet's [B, C, H, W] (a transformer block's input
#: is [B, tokens, C]: its dim 1 is what changes with the resolution); a DiT block's [B, tokens, width]
#: (tokens: image patches, times frames on a video model, plus text tokens where they are joined)
_DIMS = {"unet": {0: "batch (dim 0)", 1: "channels or tokens (dim 1)", 2: "height (dim 2)", 3: "width (dim 3)"},
         "dit": {0: "batch (dim 0)", 1: "tokens (dim 1)", 2: "width (dim 2)"}}
#: a guard that raised instead of answering (a Python error about an input, not a compiled shape)
_RAISED = re.compile(r"object has no attribute|object is not subscriptable|not supported between|Error\b")


#: region inputs that carry the prompt's tokens (their dim 1): ComfyUI's UNet and Wan/MMDiT blocks'
#: ``context``, Flux's ``txt``, diffusers' and Qwen-Image's ``encoder_hidden_states``
_TEXT_INPUTS = frozenset({"context", "txt", "encoder_hidden_states"})


def prompt_tokens(reasons) -> int | None:
    """The prompt length a recompile was for, where one of ``reasons`` (raw guard failures) is the
    token count of a region input that carries the prompt (None: no such guard)."""
    for reason in reasons:
        m = _SIZE.search(str(reason))
        if m is not None and m.group("dim") == "1" and _name(m.group("name")) in _TEXT_INPUTS:
            return int(m.group("act"))
    return None


def _name(raw: str) -> str:
    m = _NAME.match(raw)
    return m.group("n") if m else raw


_PARAM_FLAG = re.compile(r"tensor '(?P<name>.*?_parameters\['[^']+'\])' (?P<what>requires_grad|dispatch key set) mismatch")


def rank(reason: str) -> int:
    """Which reasons explain a recompile best: a weight whose flags changed (every entry of the code
    fails on it), then a shape (a region's code object is shared by blocks of several kinds, so other
    entries' unrelated guards fail too), then a dtype."""
    if _PARAM_FLAG.search(reason):
        return -1
    return 0 if _SIZE.search(reason) or _SYM.search(reason) else 1 if _DTYPE.search(reason) else 2


def plain_guard(reason: str, arch: str = "unet") -> str:
    """One guard failure in plain words (dims named as ``arch``'s, "unet" or "dit"), with the raw
    guard kept short after it; a guard that raised on this call's inputs is said as such."""
    dims = _DIMS.get(arch, _DIMS["unet"])
    reason = re.sub(r"^\[?\d+/\d+\]?:?\s*", "", str(reason).strip())   # dynamo's compile id
    reason = reason.split("  #", 1)[0].strip()                           # the source line dynamo appends
    raw = reason if len(reason) <= 160 else reason[:157] + "..."
    for pattern in (_SIZE, _DTYPE, _SYM):
        m = pattern.search(reason)
        if m is None:
            continue
        what = f"region input {_name(m.group('name'))}"
        if pattern is _DTYPE:
            return f"{what}: dtype {m.group('act')}, compiled for {m.group('exp')}"
        dim = int(m.group("dim"))
        if pattern is _SIZE:
            return f"{what}: {dims.get(dim, f'dim {dim}')} is {m.group('act')}, the code was compiled for exactly {m.group('exp')}"
        return f"{what}: {dims.get(dim, f'dim {dim}')} outside the range the code was compiled for (guard: {raw})"
    m = _PARAM_FLAG.search(reason)
    if m:
        flag = "requires_grad" if m.group("what") == "requires_grad" else "inference-tensor state"
        return (f"weight {m.group('name')}: its {flag} changed since warmup (a weight patch such as a LoRA put a "
                f"new Parameter in its place) (guard: {raw})")
    if "requires_grad mismatch" in reason or "grad_mode" in reason.lower():
        return f"grad mode differs from warmup's (guard: {raw})"
    if "dispatch key set mismatch" in reason or "inference" in reason.lower():
        return f"an input is (or is not) an inference tensor, unlike warmup's (guard: {raw})"
    if "___check_obj_id" in reason or "___check_type_id" in reason or "ID_MATCH" in reason:
        return f"an object the code depends on was replaced (a module, option or patch) (guard: {raw})"
    if _RAISED.search(reason):
        return ("an input is not what the code was compiled for (None, or another type, where it had a tensor), "
                "so its check could not run")
    return f"guard: {raw}"
