"""The ipex backend's safety net, in any env: an IPEX that does not match the
installed torch is never imported (its import kills the process) and the
model falls back, visibly, to inductor.

The real IPEX runs in its own lane (torch 2.8.0 + IPEX 2.8.0, see .ci/run):
tests/compiler/test_diffusers_unet.py with UNET_COMPILER_TEST_BACKENDS=ipex."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unet_compiler.compiler.compat import ipex as ipex_compat

CODE = """
import torch
from diffusers import UNet2DConditionModel
from unet_compiler.compiler import compile_unet, report
from unet_compiler.compiler.api import accelerator_of
from unet_compiler.compiler.backends import inductor
# the fallback's regions run their bodies uncompiled: the call path is the pack's (a lazy IPEX import
# there would kill this process), without minutes of inductor compile that other tests pay already
inductor.region_body = lambda body, *a, **k: body
u = UNet2DConditionModel(**{config}).eval()
compile_unet(u, "ipex", prepack_conv=False)
import sys
print("IPEX IMPORTED" if "intel_extension_for_pytorch" in sys.modules else "ipex not imported")
with torch.inference_mode():
    u(torch.randn(1, 4, 8, 8), torch.tensor([1.0]), torch.randn(1, 77, 32))
print(report(u))
"""


def _run(pythonpath: str, unet_config: dict):
    # (no empty entry: one is the working directory, the checkout, whose kernels/ hides Hugging Face's)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [pythonpath, os.environ.get("PYTHONPATH")])))
    code = CODE.format(config=repr(unet_config))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


def _check_fallback(r, ipex_v):
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ipex not imported" in r.stdout
    assert "backend inductor (asked ipex)" in r.stdout
    tv = torch.__version__.split("+")[0]
    assert f"IPEX {ipex_v} only works with torch" in r.stdout and f"torch {tv} is installed" in r.stdout
    assert "Fix: pip install torch==" in r.stdout


@pytest.mark.skipif(ipex_compat.mismatch("2.8.0") is None, reason="this env has torch 2.8: no mismatch to show")
def test_mismatched_ipex_is_never_imported(tmp_path, tiny_unet):
    """A stand-in IPEX 2.8.0 whose import kills the process, as the real one does."""
    pkg = tmp_path / "intel_extension_for_pytorch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import os\nprint('ERROR! IPEX needs torch 2.8')\nos._exit(127)\n")
    meta = tmp_path / "intel_extension_for_pytorch-2.8.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: intel_extension_for_pytorch\nVersion: 2.8.0\n")
    _check_fallback(_run(str(tmp_path), tiny_unet.config()), "2.8.0")


def _real_ipex_site() -> Path | None:
    site = os.environ.get("UNET_COMPILER_IPEX_SITE")
    if site and (Path(site) / "intel_extension_for_pytorch").is_dir():
        return Path(site)
    return None


@pytest.mark.skipif(_real_ipex_site() is None, reason="UNET_COMPILER_IPEX_SITE (the IPEX lane's site-packages, "
                    "set by .ci/run) not set: the real-IPEX mismatch case skips")
@pytest.mark.skipif(ipex_compat.mismatch("2.8.0") is None, reason="this env has torch 2.8: no mismatch to show")
def test_real_ipex_beside_the_wrong_torch_falls_back(tmp_path, tiny_unet):
    """The real IPEX 2.8.0 package put beside this env's torch (2.13)."""
    site = _real_ipex_site()
    for entry in site.iterdir():
        if entry.name.startswith("intel_extension_for_pytorch"):
            (tmp_path / entry.name).symlink_to(entry)
    r = _run(str(tmp_path), tiny_unet.config())
    from importlib import metadata
    v = next(metadata.distributions(path=[str(tmp_path)])).version
    _check_fallback(r, v)


def test_mismatch_sentence_names_versions_and_fix():
    msg = ipex_compat.mismatch("2.8.0", "2.13.0")
    assert "IPEX 2.8.0 only works with torch 2.8.x but torch 2.13.0 is installed" in msg
    assert "pip install torch==2.8.*" in msg and "pip uninstall intel_extension_for_pytorch" in msg
    assert ipex_compat.mismatch("2.8.0", "2.8.0+cpu") is None
    assert ipex_compat.mismatch("2.8.10+cpu", "2.8.0") is None


def test_ipex_missing_is_a_reason_not_an_error(monkeypatch):
    monkeypatch.setattr(ipex_compat, "ipex_version", lambda: None)
    ipex_compat.load.cache_clear()
    try:
        mod, why = ipex_compat.load()
        assert mod is None and "not installed" in why
    finally:
        ipex_compat.load.cache_clear()


@pytest.mark.skipif(ipex_compat.load()[0] is None, reason="IPEX not importable here (runs in the IPEX lane)")
def test_real_ipex_prepacks_quietly_and_reports_in_plain_words(caplog, recwarn, tiny_unet):
    """None of the BatchNorm-folding / concat_linear noise users saw, and the
    report says what IPEX did."""
    import logging
    from unet_compiler.compiler import compile_unet, report
    u = tiny_unet()
    compile_unet(u, "ipex")
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        u(torch.randn(1, 4, 8, 8), torch.tensor([1.0]), torch.randn(1, 77, 32))
    noise = [r.getMessage() for r in caplog.records] + [str(w.message) for w in recwarn]
    assert not [m for m in noise if "BatchNorm folding" in m or "concat_linear" in m], noise
    text = report(u)
    assert "backend ipex" in text and "conv/linear weights prepacked" in text, text
    assert "not asked of IPEX: BatchNorm folding" in text
