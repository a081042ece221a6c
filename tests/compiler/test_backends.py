"""compiler/backends/__init__.py: the registry (lookup by name, auto's order, fallback with the
reasons, a backend is one file)."""
import sys
import textwrap

import pytest
import torch

from unet_compiler.compiler.backends import lookup_backend, resolve
from unet_compiler.compiler.lifecycle.scheduler import Scheduler


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


def test_free_standing_conv_regions_are_installed_only_where_they_fire(monkeypatch):
    """Prepacked convs are oneDNN's (CPU): on CUDA every call would decline, so the regions are not
    installed there (and not counted as accelerated in the report)."""
    from unet_compiler.compiler.backends import inductor as I
    from unet_compiler.compiler.config import CompileConfig
    from unet_compiler.compiler.plan import PROJECTION
    monkeypatch.setattr(I, "_triton_missing", lambda: None)
    cuda = lookup_backend("inductor")()
    assert cuda.available(torch.device("cuda"))[0]
    cpu = lookup_backend("inductor")()
    monkeypatch.setattr(I, "_cpp_compiler_missing", lambda: None)
    assert cpu.available(torch.device("cpu"))[0]
    config = CompileConfig(backend="inductor")
    assert not [k for k in cuda.impls(config, Scheduler()) if k[1] == PROJECTION]
    assert [k for k in cpu.impls(config, Scheduler()) if k[1] == PROJECTION]
