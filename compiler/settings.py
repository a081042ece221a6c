"""Every ``UNET_COMPILER_*`` environment variable the pack reads, with its default and meaning.

Read at the moment of use (``flag`` / ``choice`` / ``value``), never cached, so a test or a
user's shell can change one between models. On/off values: ``1 true yes on`` and
``0 false no off`` (any case); anything else is the default.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

PREFIX = "UNET_COMPILER_"
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    name: str                      # without the prefix
    default: str
    meaning: str                   # one line, as the README's table says it
    choices: tuple[str, ...] = ()  # allowed values ("": a path or free text); on/off settings: ("on", "off")

    @property
    def env(self) -> str:
        return PREFIX + self.name


SETTINGS = {s.name: s for s in (
    Setting("DISABLE", "off", "on: every rewrite is off, the model's own code runs (the report says why)",
            ("on", "off")),
    Setting("CACHE", "on", "the persistent compile cache: on, off, or clear (emptied once at the first "
                           "compile of the process)", ("on", "off", "clear")),
    Setting("CACHE_DIR", "", "the compile cache's folder (default: ComfyUI's user/unet_compiler/compile_cache, "
                             "else ~/.cache/unet_compiler/compile_cache); a read-only folder is read, never written"),
    Setting("CACHE_DAYS", "30", "a compile cache entry no process loaded or saved for this many days is removed "
                                "at the next save into the folder (0: never)"),
    Setting("COMPARE", "recorded", "always: every warmup runs the eager reference, also where the cache holds "
                                   "the compare recorded when its code compiled", ("recorded", "always")),
    Setting("PRECOMPILE", "on", "off: regions compile with plain torch.compile instead of precompiled, "
                                "cacheable variants (restarts trace again)", ("on", "off")),
    Setting("SIZE_OBLIVIOUS", "on", "off: dynamic variants specialise size-1 dims (more graphs for ranges "
                                    "that reach a 1x1 deepest level)", ("on", "off")),
    Setting("CPU_ISA_RECORD", "on", "off: inductor's CPU vector-ISA probe runs in every process instead of "
                                    "being replayed from its record in the cache folder", ("on", "off")),
    Setting("BACKGROUND_CPU", "idle", "when a CPU model's background compile runs: idle (only while no prompt "
                                      "runs: beside sampling it slows every image on the same cores) or beside "
                                      "(at once)", ("idle", "beside")),
    Setting("KERNEL_CHOICE", "measure", "triton: the triton backend always runs its kernels instead of "
                                        "measuring each against torch per input signature (CUDA)",
            ("measure", "triton")),
)}


def value(name: str) -> str:
    """The variable's value as set (stripped), else its default."""
    raw = os.environ.get(SETTINGS[name].env, "").strip()
    return raw or SETTINGS[name].default


def on_off(text: str) -> bool | None:
    """An on/off word as a boolean (``1 true yes on``, ``0 false no off``, any case and spacing),
    None for any other text."""
    v = text.strip().lower()
    return True if v in _ON else False if v in _OFF else None


def flag(name: str) -> bool:
    """An on/off setting: True when on (its default where the value is neither)."""
    v = on_off(value(name))
    return SETTINGS[name].default == "on" if v is None else v


def choice(name: str) -> str:
    """One of the setting's choices (its default where the value is none of them)."""
    v, s = value(name).lower(), SETTINGS[name]
    return v if v in s.choices else s.default


def env(name: str) -> str:
    """The variable's full name (``UNET_COMPILER_<name>``), for messages."""
    return SETTINGS[name].env


def disabled() -> bool:
    """``UNET_COMPILER_DISABLE`` is on: every rewrite is off."""
    return flag("DISABLE")


def table() -> str:
    """The settings as a Markdown table (the README's; a test keeps the two equal)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{s.env}` | {s.default or '(unset)'} | {s.meaning} |" for s in SETTINGS.values()]
    return "\n".join(rows)
