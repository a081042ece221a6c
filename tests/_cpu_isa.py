"""The tests' reset of compiler/cache/cpu_isa.py, whose routing of inductor's ISA probe is per process."""
from __future__ import annotations

from unet_compiler.compiler.cache import cpu_isa


def uninstall() -> None:
    """Inductor's own probe back, nothing remembered: as in a process that never installed it."""
    with cpu_isa._lock:
        cls = cpu_isa._vec_isa_class()
        original = getattr(getattr(cls, "check_build", None), "__unet_compiler_original__", None)
        if original is not None:
            cls.check_build = original
        cpu_isa._state.update(installed=False, replayed=0, probed=0)
        cpu_isa._file.clear()
        cpu_isa._new.clear()
