"""Inductor's CPU ISA probe, remembered across processes in the pack's cache folder.

Before inductor's first C++ kernel in a process, ``torch._inductor.cpu_vec_isa`` checks which
vector ISAs (AVX2, AVX-512, VNNI, AMX, ...) this machine's compiler can build for: per ISA it
compiles a probe (kept in inductor's cache) and then ``dlopen``s it in a fresh Python subprocess
(not cached: every process pays it). Measured on this 2-core VM, torch 2.13: ``pick_vec_isa()``
0.82-0.93 s a process (6 checks), under 1 ms replayed; a one-shape SD1.5 restart through the
server had 3.0 s of compile overhead before.

Here each ``VecISA.check_build`` outcome is recorded (ISA, its flags at the call, a digest of the
probe's code) and written to ``cpu_isa.record`` in the pack's cache folder at a save; a later process
replays the outcomes instead of spawning. The record is used only where everything the outcome
depends on matches: torch's version and library folder, the Python running the probes, the
platform, the CPU's ISA flags and the C++ compiler (inductor's candidates, each resolved to its
file with its size and mtime). An outcome not in the record is probed as before. The record is
JSON (nothing unpickled); a wrong one could at worst claim an ISA the compiler cannot build,
which inductor's compile then reports and the pack runs that model eager.
``UNET_COMPILER_CPU_ISA_RECORD=off`` turns the replay off.
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
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV = "UNET_COMPILER_CPU_ISA_RECORD"
FILE = "cpu_isa.record"   # JSON, but not named *.json: those are the entries
FORMAT = "unet-compiler-cpu-isa-1"

_lock = threading.Lock()
_state = {"installed": False, "replayed": 0, "probed": 0}
_record: dict[str, bool] = {}     # outcomes this process may replay
_new: dict[str, bool] = {}        # outcomes probed in this process (written at the next save)


def enabled() -> bool:
    return os.environ.get(ENV, "on").strip().lower() not in ("0", "off", "false", "no")


def _vec_isa_class():
    try:
        from torch._inductor import cpu_vec_isa
        cls = cpu_vec_isa.VecISA
    except Exception:
        return None
    return cls if callable(getattr(cls, "check_build", None)) else None


def _compiler_facts() -> list:
    try:
        from torch._inductor import config
        cxx = config.cpp.cxx
    except Exception:
        return ["unknown"]
    out = []
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
    return out


@functools.lru_cache(maxsize=1)
def machine_key() -> str:
    """What a probe's outcome depends on, as one digest."""
    try:
        from torch._inductor.cpu_vec_isa import x86_isa_checker
        flags = sorted(x86_isa_checker()) if platform.machine() in ("x86_64", "AMD64") else []
    except Exception:
        flags = ["unknown"]
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
    flags = getattr(isa, "_arch_flags", "")
    return f"{isa}|{flags}|{hashlib.sha256(code.encode()).hexdigest()[:16]}"


def install(folder: Path) -> None:
    """Read ``folder``'s record (if it matches this machine) and route inductor's ISA probes
    through it. Once per process; never raises."""
    if not enabled():
        return
    with _lock:
        if _state["installed"]:
            return
        _state["installed"] = True
        cls = _vec_isa_class()
        if cls is None:
            return
        try:
            data = json.loads((Path(folder) / FILE).read_text())
            if data.get("format") == FORMAT and data.get("machine") == machine_key():
                _record.update({k: v for k, v in data.get("outcomes", {}).items() if isinstance(v, bool)})
        except (OSError, ValueError, AttributeError):
            pass
        original = cls.check_build

        @functools.wraps(original)
        def check_build(self, code: str) -> bool:
            key = _outcome_key(self, code)
            with _lock:
                if key in _record:
                    _state["replayed"] += 1
                    return _record[key]
            ok = bool(original(self, code))
            with _lock:
                _new[key] = ok
                _record[key] = ok
                _state["probed"] += 1
            return ok

        check_build.__unet_compiler_original__ = original
        cls.check_build = check_build


def uninstall() -> None:
    """Inductor's own probe back (tests)."""
    with _lock:
        cls = _vec_isa_class()
        original = getattr(getattr(cls, "check_build", None), "__unet_compiler_original__", None)
        if original is not None:
            cls.check_build = original
        _state.update(installed=False, replayed=0, probed=0)
        _record.clear()
        _new.clear()


def save(folder: Path) -> None:
    """Write the outcomes probed in this process into ``folder``'s record (merged with a matching
    one already there). A read-only folder keeps nothing; never raises."""
    with _lock:
        if not _new:
            return
        new = dict(_new)
    path = Path(folder) / FILE
    outcomes: dict = {}
    try:
        old = json.loads(path.read_text())
        if old.get("format") == FORMAT and old.get("machine") == machine_key():
            outcomes.update({k: v for k, v in old.get("outcomes", {}).items() if isinstance(v, bool)})
    except (OSError, ValueError, AttributeError):
        pass
    outcomes.update(new)
    data = json.dumps({"format": FORMAT, "machine": machine_key(), "outcomes": outcomes}, indent=1, sort_keys=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=FILE + ".", suffix=".partial")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
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
