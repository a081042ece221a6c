"""Fast checks: shape validation, config, backend registry, env switch, clean import."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from unet_compiler.compiler.backends import lookup_backend, resolve
from unet_compiler.compiler.config import CompileConfig
from unet_compiler.compiler.shapes import Shape, ShapeError, parse_shapes, probe_shapes, validate_shapes_input

ROOT = Path(__file__).resolve().parents[1]

BAD = [
    ("512x", "not BxWxH"),
    ("0x64x64", "batch 0"),
    ("-1x64x64", "not BxWxH"),
    ("abc", "not BxWxH"),
    ("1x100x64", "not divisible by 8"),
    ("1x64x68", "not divisible by 8"),
    ("1x100000x100000", "must be between"),
    ("1x32x64", "must be between"),
    ("65x64x64", "batch 65"),
    ("", "empty"),
    ("1x64x64, 1x64", "not BxWxH"),
]


@pytest.mark.parametrize("text,why", BAD)
def test_malformed_shapes_rejected_naming_the_entry(text, why):
    with pytest.raises(ShapeError) as e:
        parse_shapes(text)
    assert why in str(e.value)
    bad_entry = text.split(",")[-1].strip()
    if bad_entry:
        assert repr(bad_entry) in str(e.value)
    # the node rejects it in validate, before any work (Warmup Shapes' validate_inputs returns this)
    msg = validate_shapes_input(text)
    assert isinstance(msg, str) and why in msg


def test_good_shapes_parse():
    assert parse_shapes("1x512x512\n2x768x512, 4X64x64") == [Shape(1, 512, 512), Shape(2, 768, 512), Shape(4, 64, 64)]
    assert validate_shapes_input("1x512x512") is True


def test_probe_shapes_cover_specialisations_generic_first():
    probes = probe_shapes([Shape(1, 64, 64), Shape(4, 1024, 1024)])
    assert probes[0] == Shape(2, 128, 192)
    assert {p.batch for p in probes} == {1, 2} and {p.width for p in probes} == {64, 128}
    assert probe_shapes([Shape(2, 512, 512)]) == [Shape(2, 128, 192)]


def test_config_rejects_unknown_values():
    with pytest.raises(ValueError, match="backend='fast'"):
        CompileConfig(backend="fast")
    with pytest.raises(ValueError, match="precision"):
        CompileConfig(precision="fp8")
    with pytest.raises(TypeError, match="unknown option"):
        CompileConfig.from_options("auto", dynamc_shapes=True)


def test_registry_reports_unavailable_backends_and_falls_back():
    backend, story = resolve("triton", torch.device("cpu"))
    assert backend.name == "inductor" and story[0].startswith("triton: ")
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in story[0]
    backend, story = resolve("auto", torch.device("cpu"))
    assert backend.name == "inductor"
    assert any(s.startswith("ipex:") for s in story)
    with pytest.raises(KeyError):
        lookup_backend("tensorrt")


def test_a_backend_is_one_file(tmp_path, monkeypatch):
    """A module named as the backend, found on the backends package's path, is in the menus' order,
    the tooltip and auto's order: nothing else names it."""
    import unet_compiler.compiler.backends as B
    from unet_compiler.compiler.config import BACKENDS
    assert BACKENDS == ("auto",) + B.names() and set(B.names()) == {"triton", "ipex", "inductor", "eager"}
    assert B.names() == ("triton", "ipex", "inductor", "eager"), "auto's order"
    (tmp_path / "turbo.py").write_text(textwrap.dedent("""
        from unet_compiler.compiler.backends import Backend, register_backend

        @register_backend("turbo")
        class Turbo(Backend):
            auto_rank, summary = 1.5, "a test backend"

            def available(self, device):
                return True, "always"
    """))
    monkeypatch.setattr(B, "__path__", list(B.__path__) + [str(tmp_path)])
    try:
        assert B.names() == ("triton", "ipex", "turbo", "inductor", "eager")
        assert "then ipex, then turbo, then inductor" in B.tooltip() and "turbo: a test backend" in B.tooltip()
        backend, story = resolve("auto", torch.device("cpu"))
        assert backend.name == "turbo" and story[-1] == "turbo: chosen (always)", story
        assert resolve("turbo", torch.device("cpu"))[0].name == "turbo"
    finally:
        B._REGISTRY.pop("turbo", None)
        sys.modules.pop(B.__name__ + ".turbo", None)


def _run(code, env_extra=None):
    import os
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, cwd=str(ROOT.parent))


def test_pack_imports_without_comfyui_triton_ipex_diffusers():
    code = f"""
    import sys, importlib.util, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] in ('comfy', 'comfy_api', 'triton', 'intel_extension_for_pytorch', 'diffusers'):
                raise ImportError('blocked ' + name)
    sys.meta_path.insert(0, Block())
    spec = importlib.util.spec_from_file_location('some_custom_node_dir', {str(ROOT / '__init__.py')!r},
                                                  submodule_search_locations=[{str(ROOT)!r}])
    mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod)
    # no ComfyUI: nothing registered (V1 is gone; an older ComfyUI gets a log line, test below)
    assert not hasattr(mod, 'NODE_CLASS_MAPPINGS') and mod.WEB_DIRECTORY == './web'
    assert not hasattr(mod, 'comfy_entrypoint')
    from some_custom_node_dir.compiler.backends import resolve
    import torch
    b, _ = resolve('inductor', torch.device('cpu'))
    assert 'triton' not in sys.modules and 'intel_extension_for_pytorch' not in sys.modules
    print('ok', b.name)
    """
    r = _run(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ok inductor" in r.stdout


def test_env_switch_turns_everything_off():
    code = """
    import torch
    from diffusers import UNet2DConditionModel
    from unet_compiler.compiler import compile_unet, report
    u = UNet2DConditionModel(sample_size=8, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8, norm_num_groups=8)
    compile_unet(u, "inductor")
    print(report(u))
    """
    r = _run(code, {"UNET_COMPILER_DISABLE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "backend eager (asked inductor)" in r.stdout and "UNET_COMPILER_DISABLE is set" in r.stdout


def test_old_comfyui_gets_one_log_line_and_no_nodes():
    """A ComfyUI without comfy_api.latest (older than pyproject's requires-comfyui): one line, no nodes."""
    code = f"""
    import sys, types, logging, importlib.util, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] == 'comfy_api':
                raise ImportError('blocked ' + name)
    sys.meta_path.insert(0, Block())
    sys.modules['comfy'] = types.ModuleType('comfy')   # ComfyUI's own package, loaded before custom nodes
    logging.basicConfig(level=logging.INFO, format='%(message)s')
    spec = importlib.util.spec_from_file_location('some_custom_node_dir', {str(ROOT / '__init__.py')!r},
                                                  submodule_search_locations=[{str(ROOT)!r}])
    mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod)
    assert not hasattr(mod, 'NODE_CLASS_MAPPINGS') and not hasattr(mod, 'comfy_entrypoint')
    print(mod.MIN_COMFYUI)
    """
    r = _run(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == ["ComfyUI too old: UNet Compiler needs >= 0.3.48"], r.stderr
    import tomllib
    floor = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["comfy"]["requires-comfyui"]
    assert floor == ">=" + r.stdout.strip() == ">=0.3.48"


def test_library_api_at_the_top_level():
    """``from unet_compiler import compile_unet, warmup, report``; importing the package alone (what
    ComfyUI's node loading does first) imports neither torch nor the compiler."""
    code = """
    import sys, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] in ('comfy', 'comfy_api'):
                raise ImportError('blocked ' + name)
    sys.meta_path.insert(0, Block())
    import unet_compiler
    assert 'torch' not in sys.modules and 'unet_compiler.compiler' not in sys.modules, 'imported eagerly'
    from unet_compiler import compile_unet, report, uncompile_unet, warmup
    from unet_compiler.compiler import api
    assert (compile_unet, warmup, report, uncompile_unet) == (api.compile_unet, api.warmup, api.report,
                                                              api.uncompile_unet)
    try:
        unet_compiler.nope
    except AttributeError:
        print('ok')
    """
    r = _run(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "ok"
