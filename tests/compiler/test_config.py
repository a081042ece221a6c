"""compiler/config.py: CompileConfig's checks and the one switch (UNET_COMPILER_DISABLE) that turns
every rewrite off."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from unet_compiler.compiler.config import CompileConfig

ROOT = Path(__file__).resolve().parents[2]


def test_config_rejects_unknown_values():
    with pytest.raises(ValueError, match="backend='fast'"):
        CompileConfig(backend="fast")
    with pytest.raises(ValueError, match="precision"):
        CompileConfig(precision="fp8")
    with pytest.raises(TypeError, match="unknown option"):
        CompileConfig.from_options("auto", dynamc_shapes=True)
    # a string is not a switch: "false" would have read as True
    with pytest.raises(TypeError, match="dynamic_shapes='false' must be True or False"):
        CompileConfig.from_options("auto", dynamic_shapes="false")
    with pytest.raises(TypeError, match="cuda_graphs=1 must be True or False"):
        CompileConfig(cuda_graphs=1)
    assert CompileConfig(dynamic_shapes=None).dynamic_shapes is None   # the runtime's one-shape mode


def _run(code, env_extra=None):
    import os
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, cwd=str(ROOT.parent))


def test_env_switch_turns_everything_off(tiny_unet):
    code = """
    import torch
    from diffusers import UNet2DConditionModel
    from unet_compiler.compiler import compile_unet, report
    u = UNet2DConditionModel(**{config})
    compile_unet(u, "inductor")
    print(report(u))
    """.format(config=repr(tiny_unet.config()))
    r = _run(code, {"UNET_COMPILER_DISABLE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "backend eager (asked inductor)" in r.stdout and "UNET_COMPILER_DISABLE is set" in r.stdout
