"""Inductor's CPU ISA probe, recorded in the cache folder and replayed by later processes.

Inductor dlopens one probe per vector ISA in a fresh subprocess in every process; each check that
succeeds is recorded in ``cpu_isa.record`` (JSON, per machine key) at a save and replayed only
where torch, Python, platform, CPU flags, ``TORCHINDUCTOR_CPP_MARCH`` and the C++ compiler all
match. Failures are never recorded; a read-only folder is never written.
``UNET_COMPILER_CPU_ISA_RECORD=off`` turns the replay off. Measurements: DEVELOPERS.md.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path

import torch

from .. import settings
from . import files

log = logging.getLogger(__name__)

FILE = "cpu_isa.record"   # JSON, but not named *.json: those are the entries
FORMAT = "unet-compiler-cpu-isa-2"
MAX_MACHINES = 32         # a folder shared by machines of several kinds keeps each one's outcomes

_lock = threading.Lock()
_state = {"installed": False, "replayed": 0, "probed": 0}
_file: dict = {}                  # {machine key: {outcome key: True}}: the folder's, and this process's successes
_new: dict[str, bool] = {}        # successes probed in this process (written at the next save)


def enabled() -> bool:
    return settings.flag("CPU_ISA_RECORD")


def _vec_isa_class():
    try:
        from torch._inductor import cpu_vec_isa
        cls = cpu_vec_isa.VecISA
    except Exception:
        return None
    return cls if callable(getattr(cls, "check_build", None)) else None


def _compiler_facts() -> list:
    """The C++ compiler inductor's probes are built with: its version string (inductor's own probe
    fingerprint) and every candidate's file."""
    out: list = []
    try:
        from torch._inductor import config
        from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler
        out.append(get_compiler_version_info(get_cpp_compiler()))
        out.append(["march", getattr(config.cpp, "march", None)])
        cxx = config.cpp.cxx
    except Exception as e:
        return out + [f"unknown ({type(e).__name__})"]
    for c in (cxx if isinstance(cxx, (list, tuple)) else (cxx,)):
        if c is None:
            out.append(["conda gxx", os.environ.get("TORCH_INDUCTOR_INSTALL_GXX")])
            continue
        path = shutil.which(c)
        try:
            real = os.path.realpath(path) if path else None
            st = os.stat(real) if real else None
        except OSError:
            real, st = None, None
        out.append([c, real, st.st_size if st else None, st.st_mtime_ns if st else None])
    out.append(["CXX", os.environ.get("CXX")])
    return out


def isa_flags() -> list:
    """The vector ISAs this CPU has: on x86 as inductor checks them; elsewhere (ARM: NEON, SVE and
    its vector length, which inductor's ISA choice reads) the features torch's CPU info reports."""
    try:
        if platform.machine() in ("x86_64", "AMD64"):
            from torch._inductor.cpu_vec_isa import x86_isa_checker
            return sorted(x86_isa_checker())
        caps = torch.cpu.get_capabilities()
        return sorted([k for k, v in caps.items() if v is True]
                      + [f"{k}={v}" for k, v in caps.items() if "sve" in k and type(v) is int])
    except Exception:
        return ["unknown"]


def build_facts() -> dict:
    """What inductor's CPU code is generated and built for, without running its probes: the CPU's
    vector ISAs, ATen's capability override, inductor's SIMD length and -march. Code compiled for
    one ISA and rebuilt for another computes garbage (NaN in a review's repro): a compile cache
    entry is keyed by these."""
    try:
        from torch._inductor import config
        simdlen, march = config.cpp.simdlen, getattr(config.cpp, "march", None)
    except Exception:
        simdlen = march = None
    return {"isa": isa_flags(), "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY"), "simdlen": simdlen,
            "march": os.environ.get("TORCHINDUCTOR_CPP_MARCH") or march, "machine": platform.machine()}


@functools.lru_cache(maxsize=1)
def machine_key() -> str:
    """What a probe's outcome depends on, as one digest."""
    flags = isa_flags()
    caps = {}
    try:
        caps = {k: v for k, v in sorted(torch.cpu.get_capabilities().items()) if isinstance(v, (bool, int, str))}
    except Exception:
        pass
    facts = {"format": FORMAT, "torch": torch.__version__, "torch_lib": os.path.dirname(torch.__file__),
             "python": sys.executable, "platform": [sys.platform, platform.machine()], "isa_flags": flags,
             "capabilities": caps, "compiler": _compiler_facts()}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _outcome_key(isa, code: str) -> str:
    try:
        flags = isa.build_arch_flags()
    except Exception:
        flags = getattr(isa, "_arch_flags", "")
    return f"{isa}|{flags}|{hashlib.sha256(code.encode()).hexdigest()[:16]}"


def _read(folder: Path) -> dict:
    """{machine key: {outcome: True}} of ``folder``'s record ({} when absent or not the pack's)."""
    try:
        data = json.loads(files.read_text(Path(folder) / FILE))
        if data.get("format") != FORMAT:
            return {}
        return {str(m): {str(k): True for k, v in outs.items() if v is True}
                for m, outs in data.get("machines", {}).items() if isinstance(outs, dict)}
    except (OSError, ValueError, AttributeError):
        return {}


def install(folder: Path) -> None:
    """Read ``folder``'s record and route inductor's ISA probes through it. Once per process;
    never raises."""
    if not enabled():
        return
    with _lock:
        if _state["installed"]:
            return
        _state["installed"] = True
        cls = _vec_isa_class()
        if cls is None:
            return
        _file.update(_read(folder))
        original = cls.check_build

        @functools.wraps(original)
        def check_build(self, code: str) -> bool:
            machine = machine_key()   # (first at the first check: inductor picks its compiler there anyway)
            key = _outcome_key(self, code)
            with _lock:
                if _file.get(machine, {}).get(key):
                    _state["replayed"] += 1
                    return True
            ok = bool(original(self, code))
            with _lock:
                _state["probed"] += 1
                if ok:
                    _new[key] = _file.setdefault(machine, {})[key] = True
            return ok

        check_build.__unet_compiler_original__ = original
        cls.check_build = check_build


def save(folder: Path) -> None:
    """Add the successes probed in this process to ``folder``'s record, under this machine's key
    (other machines' outcomes kept). A read-only folder is left alone; never raises."""
    with _lock:
        if not _new:
            return
        new = dict(_new)
    folder = Path(folder)
    if folder.is_dir() and not files.writable(folder):
        return
    machines = _read(folder)
    key = machine_key()
    mine = {**machines.pop(key, {}), **new}
    machines = dict(list(machines.items())[-(MAX_MACHINES - 1):]) if MAX_MACHINES > 1 else {}
    machines[key] = mine
    data = json.dumps({"format": FORMAT, "machines": machines}, indent=1)   # insertion order: newest last
    path = folder / FILE
    try:
        folder.mkdir(parents=True, exist_ok=True)
        files.atomic_write(path, data.encode())
    except OSError as e:
        log.debug("UNet Compiler: CPU ISA record not written to %s (%s)", path, e)
        return
    with _lock:
        for k in new:
            _new.pop(k, None)


def counts() -> dict:
    """{"replayed": n, "probed": n} in this process."""
    with _lock:
        return {"replayed": _state["replayed"], "probed": _state["probed"]}
