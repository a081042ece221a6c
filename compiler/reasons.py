"""The error vocabulary: why something cannot run here, as a :class:`Reason` (``what``, ``why``,
``fix``; its ``str`` is the sentence the log and the report print), and the reasons the compile
path builds from errors (a machine that cannot build compiled code, a region kind that failed at run
time, a compiled result off the model's own). Everything below the report (compat/, backends/, the
cast and the compile lifecycle) says why with these; report.py only draws them for users.
"""
from __future__ import annotations

import re

from . import settings

DISABLE_ENV = settings.env("DISABLE")

#: why a UNet call with autograd on runs the model's own code (said once in the report)
GRAD_ON = ("a UNet call with autograd on (training, or guidance by gradients) ran the model's own code: "
           "the compiled code is for inference only")


class Reason(str):
    """Why something cannot run here, with its parts: ``what`` (the subject, "" when the sentence
    has none), ``why`` (the cause) and ``fix`` (what the user does; "" when the cause names none).

    It is the sentence itself (a ``str``: logged, joined, compared and sent as JSON unchanged):
    ``<what>: <why>. Fix: <fix>`` unless ``text`` spells it otherwise (a message whose wording
    users already know)."""

    what: str
    why: str
    fix: str

    def __new__(cls, why: str, fix: str = "", what: str = "", text: str | None = None):
        if text is None:
            text = why + (f". Fix: {fix}" if fix else "")
        self = super().__new__(cls, f"{what}: {text}" if what else text)
        self.what, self.why, self.fix = what, why, fix
        return self

    def __getnewargs__(self):  # pickle / copy: rebuild from the parts, not from the sentence
        return (self.why, self.fix, self.what, self[len(self.what) + 2:] if self.what else str(self))

    def about(self, what: str) -> Reason:
        """The same reason, said of ``what`` (``<what>: ...``)."""
        return Reason(self.why, self.fix, what, self[len(self.what) + 2:] if self.what else str(self))

    @property
    def cause(self) -> str:
        """The sentence without its fix: ``<what>: <why>``."""
        return f"{self.what}: {self.why}" if self.what else self.why

    @classmethod
    def of(cls, text: str, what: str = "") -> Reason:
        """``text`` as a Reason: itself when it is one, else read from a plain sentence (what a
        backend outside this package may still return): a leading ``<name>: `` is ``what``; a
        ``Fix: ...``, a trailing ``; install ...`` or ``(use <backend>)`` is the fix."""
        if isinstance(text, Reason):
            return text.about(what) if what and not text.what else text
        body = str(text)
        if not what:
            m = re.match(r"([\w.+-]+): ", body)
            if m:
                what, body = m.group(1), body[m.end():]
        m = re.search(r"\s*\bFix:\s*", body)
        if m:
            return cls(body[:m.start()].rstrip(" .;"), body[m.end():].rstrip(" ."), what, body)
        m = re.search(r";\s*(install .+)$", body)
        if m:
            return cls(body[:m.start()], m.group(1).rstrip(" .") + ", then restart ComfyUI", what, body)
        m = re.search(r"\s*\(use (\w+)\)\s*$", body)
        if m:
            return cls(body[:m.start()], f"choose {m.group(1)} or auto in Select Backend", what, body)
        return cls(body, "", what)


#: the backend choice of a model that is no UNet the pack knows (its plan's one skipped "region" says
#: which model and why): not a failure, nothing for the user to fix
NOTHING_TO_COMPILE = "nothing to compile, running eager"


class Slower(Reason):
    """A region kind that runs the model's own code because that measured faster here (backend
    ``auto`` keeps the faster): a choice, not a failure."""


def wrong_result(diff: float, tolerance: float, label: str) -> Reason:
    """Warmup's compare found the compiled result off the model's own by more than the tolerance
    (the region kinds it names run the model's own code from now on)."""
    return Reason(f"their compiled result differed from the model's own: max |compiled - eager| {diff:.3g} {label}, "
                  f"over the tolerance {tolerance:.2g}",
                  "none needed for the image (it is the model's own); report it with the log: a compiled region "
                  "gave a wrong result")


def runtime_fallback(backend: str, kind: str, error: str) -> Reason:
    """A region kind failed at run time (``error``; a ``Reason`` with its own fix, such as
    :func:`build_failure`'s, keeps that fix) and runs the model's own code from now on."""
    fix = getattr(error, "fix", "") or (
        f"none needed for correctness (they run ComfyUI's own code); to silence this choose eager in "
        f"Select Backend or set {DISABLE_ENV}=1, and report the error with the log")
    why = f"{kind} regions failed ({getattr(error, 'why', error)}) and run the model's own code now"
    return Reason(why, fix, backend, text=f"fallback: {why}. Fix: {fix}.")


def _chain(error: BaseException):
    """``error`` and what it wraps: its cause, context and dynamo's ``inner_exception``."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = (getattr(error, "inner_exception", None) or error.__cause__ or error.__context__)


#: how a compiler's output says a build failed; the line that says it is what the user reads
_BUILD_ERROR = re.compile(r"(fatal error|error [A-Z]+\d+|error:|cannot open include file|python\.h)", re.I)


def build_failure(error: BaseException, system: str | None = None) -> Reason | None:
    """Why a compile failed when this machine cannot build compiled code at all (a C/C++ compiler
    that is missing or broken, no Python headers): every region kind would fail the same way. The
    reason is the compiler's own error line, not its command line; the fix is the platform's
    (``system``: ``platform.system()``). None: not a build failure."""
    import platform
    import subprocess
    for e in _chain(error):
        build = isinstance(e, subprocess.CalledProcessError) or type(e).__name__ in ("CppCompileError",
                                                                                    "InvalidCxxCompiler")
        text = "\n".join(str(x) for x in (e, getattr(e, "output", None), getattr(e, "stderr", None)) if x)
        if not build and not re.search(r"python\.h|cl\.exe", text, re.I):
            continue
        line = next((ln.strip() for ln in text.splitlines() if _BUILD_ERROR.search(ln)), "")
        if not line and isinstance(e, subprocess.CalledProcessError):
            line = f"the compiler exited with status {e.returncode}"
        line = line[:200] or "the C/C++ compiler failed"
        why = f"this machine cannot build the compiled code ({line})"
        if (system or platform.system()) == "Windows":
            fix = ("install Visual Studio Build Tools with the C++ workload and start ComfyUI from the 'x64 Native "
                   "Tools Command Prompt for VS'; for triton-windows on the portable build also copy Python's "
                   "'include' and 'libs' folders into python_embeded (its install guide); or choose eager")
        else:
            fix = "install a C/C++ compiler and Python's headers (Debian/Ubuntu: apt install build-essential python3-dev)"
        return Reason(why, fix)
    return None


def error_summary(error: BaseException) -> str:
    """``<type>: <first line>`` of an error, for the report. A first line that only introduces the
    cause (dynamo's ``backend='...' raised:``, with the compiler's own error on the next line) gets
    that next line too: the cause is what the user needs."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text += " " + lines[1]
    return f"{type(error).__name__}: {text}"[:300]
