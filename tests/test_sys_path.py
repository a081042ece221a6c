"""No process the project starts has the checkout on ``sys.path``: there its top-level folders would
import as top-level packages, and its ``kernels/`` hides Hugging Face's ``kernels``, which diffusers'
UNet imports (through its peft loader) where transformers >= 5 installed it. Each kind of process is
started here the way the project starts it and runs tests/_imports.py's check; the tests and the
bench refuse to start with the checkout on ``sys.path`` (tests/_pack.py's ``shadow_problem``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from unet_compiler.tests._pack import ROOT, shadow_problem, shadowing

DEV = str(ROOT / "bin" / "dev.py")
CHECK = ["-m", "unet_compiler.tests._imports"]
#: the same check from ``-c`` (what the tests' and the bench's child scripts are)
CHECK_C = ["-c", "import runpy; runpy.run_module('unet_compiler.tests._imports', run_name='__main__')"]


def _ran(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_this_process_imports_diffusers_unet_beside_hf_kernels():
    """The tests' own process (bin/test: ``python -m pytest`` in the checkout): the checkout is not on
    ``sys.path``, diffusers' UNet and its peft loader import, and ``kernels`` (when installed) is
    Hugging Face's."""
    from unet_compiler.tests._imports import check
    got = check()
    assert got["ok"], got
    if got["versions"]["kernels"]:
        import kernels
        assert os.path.dirname(os.path.realpath(kernels.__file__)) != os.path.realpath(ROOT / "kernels"), kernels.__file__


def test_the_lock_has_the_packages_that_broke_a_fresh_env():
    """The env under test holds what a fresh env resolved on 2026-12-06 and broke on: transformers 5,
    which installs Hugging Face's ``kernels`` (the lock pins both; tests/test_packaging.py checks the
    env is the lock)."""
    from unet_compiler.tests._imports import check
    versions = check()["versions"]
    assert versions["kernels"] and int(versions["transformers"].split(".")[0]) >= 5, versions


@pytest.mark.parametrize("kind", ["bin/dev.py python -m", "child -m", "child -c", "script in the ComfyUI tree"])
def test_each_kind_of_process_imports_diffusers_unet(kind):
    """Started as the project starts each kind, in the checkout: through bin/dev.py (what bin/test,
    bin/bench and CI's lanes run), as a child of the tests or the bench (``python -m`` or ``-c``,
    the environment inherited), and as a script in the ComfyUI tree (the e2e servers' helpers, with
    ``comfy_server.subprocess_env()``)."""
    env, cwd = dict(os.environ), str(ROOT)
    if kind == "bin/dev.py python -m":
        cmd, env["UNET_COMPILER_ENV"] = [sys.executable, DEV, "python", *CHECK], sys.prefix
        env.pop("PYTHONSAFEPATH", None)   # bin/dev.py sets it, whoever calls it
    elif kind == "child -m":
        cmd = [sys.executable, *CHECK]
    elif kind == "child -c":
        cmd = [sys.executable, *CHECK_C]
    else:
        from unet_compiler.bench.comfy_server import subprocess_env
        from unet_compiler.tests._families import comfy_path, comfy_problem
        if comfy_problem():
            pytest.skip(comfy_problem())
        env, cwd = subprocess_env(), str(comfy_path())
        assert "PYTHONSAFEPATH" not in env   # main.py needs its own folder on sys.path
        cmd = [sys.executable, "-c", "import os, sys; sys.path.insert(0, os.getcwd()); from comfy.cli_args import args; "
               "args.cpu = True; import nodes, folder_paths; " + CHECK_C[1]]
    got = _ran(subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300))
    assert got["ok"] and got["versions"]["diffusers"], got


def test_bin_test_and_bin_bench_start_without_the_checkout_on_sys_path():
    """bin/test's process (``bin/dev.py test``) runs this file's in-process check; bin/bench's
    (``bin/dev.py bench``) starts (the bench refuses to with the checkout on ``sys.path``)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    env["UNET_COMPILER_ENV"] = sys.prefix
    test = subprocess.run([sys.executable, DEV, "test",
                           "tests/test_sys_path.py::test_this_process_imports_diffusers_unet_beside_hf_kernels"],
                          cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=300)
    assert test.returncode == 0 and "1 passed" in test.stdout, test.stdout[-3000:] + test.stderr[-2000:]
    bench = subprocess.run([sys.executable, DEV, "bench", "--help"], cwd=str(ROOT), env=env, capture_output=True,
                           text=True, timeout=300)
    assert bench.returncode == 0 and "--size" in bench.stdout, bench.stdout[-2000:] + bench.stderr[-2000:]


def test_the_tests_and_the_bench_refuse_the_checkout_on_sys_path():
    """``python -m`` in the checkout without ``PYTHONSAFEPATH`` (how bin/dev.py started them before):
    the bench exits 2 and pytest stops at its start, each with the line naming the fix, instead of
    failing later on diffusers' import. The check itself: the checkout as a path or as ``''`` in it."""
    assert shadow_problem([str(ROOT)]) and shadow_problem([""], cwd=str(ROOT)) and shadowing(["", "/x"], cwd=str(ROOT)) == [""]
    assert shadow_problem(["", str(ROOT.parent), "/usr/lib/python3"], cwd=str(ROOT.parent)) is None
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    bench = subprocess.run([sys.executable, "-m", "unet_compiler.bench", "--help"], cwd=str(ROOT), env=env,
                           capture_output=True, text=True, timeout=120)
    assert bench.returncode == 2 and "is on sys.path" in bench.stderr and "PYTHONSAFEPATH=1" in bench.stderr, bench.stderr
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "tests/test_sys_path.py"],
                           cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=120)
    assert tests.returncode == 4 and "is on sys.path" in tests.stdout + tests.stderr, tests.stdout + tests.stderr


def test_ci_starts_every_lane_without_the_checkout_on_sys_path():
    """.ci/run exports ``PYTHONSAFEPATH=1`` before it starts any python (its lanes in other envs run
    ``python -m pytest`` and ``-m unet_compiler.bench`` in the checkout), and runs the README's main
    job at its smoke size and the newest lane."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    export = ci.index("\nexport PYTHONSAFEPATH=1")
    first_python = min(i for i in (ci.find("python3 -m venv"), ci.find("/bin/python"), ci.find("\nbin/"),
                                   ci.find("/bin/pip")) if i >= 0)
    assert export < first_python, "PYTHONSAFEPATH=1 is exported after a python starts"
    assert "\n  bin/bench --size tiny\n" in ci and "bin/setup --newest" in ci
