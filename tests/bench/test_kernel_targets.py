"""bench/targets.py: what it reads out of PTX / SASS, and one real compile for a GPU
this machine does not have (the full check over every target runs as its own CI lane)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from unet_compiler.bench import targets

LOOP_PTX = """
\tld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
$L__BB0_1:
\t@%p1 ld.global.b16 { %rs1 }, [ %rd2 + 0 ];
\tcp.async.cg.shared.global [ %r5 + 0 ], [ %rd3 + 0 ], 0x10, %r6;
\t@%p2 bra $L__BB0_1;
\tst.global.v2.b32 [ %rd4 + 0 ], { %r7, %r8 };
"""


def test_widths_counts_bytes_per_access_and_finds_narrow_loads_in_loops():
    ld, st, cp, loop_min = targets.widths(LOOP_PTX)
    assert (ld, st, cp) == ("16:1,2:1", "8:1", "16:1")
    assert loop_min == 2  # the 2-byte load sits between the label and the branch back to it
    assert targets.widths(LOOP_PTX.replace("@%p2 bra $L__BB0_1;", ""))[3] == 0


def _sass(*lines):
    return "\n".join(f"        /*{a:04x}*/                   {ins} ;   /* 0x0 */" for a, ins in lines)


def test_hot_spills_counts_only_the_loop_unless_there_is_none():
    prologue_spill = _sass((0x10, "STL [R1], R2"), (0x20, "FFMA R3, R4, R5, R6"), (0x30, "@P0 BRA 0x20"),
                           (0x40, "LDL.LU R4, [R1]"), (0x50, "BRA 0x50"))
    assert targets.hot_spills(prologue_spill) == 0  # around the loop; the last line is the end-of-kernel trap
    in_loop = _sass((0x10, "FFMA R3, R4, R5, R6"), (0x20, "STL [R1], R2"), (0x30, "LDL R2, [R1]"),
                    (0x40, "@P0 BRA 0x10"), (0x50, "EXIT"))
    assert targets.hot_spills(in_loop) == 2
    no_loop = _sass((0x10, "STL [R1], R2"), (0x20, "LDL R2, [R1]"), (0x30, "EXIT"), (0x40, "BRA 0x40"))
    assert targets.hot_spills(no_loop) == 2  # a loop-free kernel: its whole body is the hot path


def test_occupancy_names_the_limiter():
    assert targets.occupancy(90, 8, 113, 49152) == "16w/SM regs"
    assert targets.occupancy(89, 4, 32, 0) == "48w/SM warps"
    assert targets.occupancy(90, 4, 58, 73728) == "12w/SM smem"


def _nvidia_backend() -> bool:
    return importlib.util.find_spec("triton") is not None and \
        importlib.util.find_spec("triton.backends.nvidia") is not None


@pytest.mark.skipif(not _nvidia_backend(), reason="triton with its NVIDIA backend (ptxas) is not installed")
def test_compiles_for_a_gpu_that_is_not_here():
    """The epilogue kernel for sm_89 on this machine: a variant line with registers,
    16-byte accesses, and exit 0. A fresh process: the check must not run interpreted."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "unet_compiler.bench", "targets", "--cap", "89", "--dtype", "fp16",
                        "--only", "epilogue"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if "_bias_residual_kernel" in ln)
    assert line.startswith("sm_89") and " regs " in line and "st 16:" in line, line
