"""Packs already in the ComfyUI tree's own custom_nodes folder (this pack installed from the
Manager, under another name and under this checkout's own name, and another pack with a node, a
web extension and a prestartup script) change no result: a test server loads only the pack under
test and tests/e2e/comfy_test_node (``comfy_server.only_these_custom_nodes``: ComfyUI's
``--base-directory``, ``--disable-all-custom-nodes`` and ``--whitelist-custom-nodes``).

The tree is a shadow of the real one (its top-level modules copied, so ComfyUI's folder_paths takes
the shadow's folder for its own; every other entry linked): the real tree is never written."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from unet_compiler.bench import comfy_server as S

pytestmark = pytest.mark.e2e

TEST_NODE = Path(__file__).resolve().parent / "comfy_test_node"
INTRUDER = '''
import os
import pathlib

pathlib.Path(os.environ["UNET_COMPILER_INTRUDER_MARKS"], "imported").touch()


class Intruder:
    CATEGORY, RETURN_TYPES, FUNCTION, OUTPUT_NODE = "intruder", (), "run", True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    def run(self):
        return ()


NODE_CLASS_MAPPINGS = {"UNetCompilerTest_Intruder": Intruder}
WEB_DIRECTORY = "./web"
'''
PRESTARTUP = 'import os, pathlib\npathlib.Path(os.environ["UNET_COMPILER_INTRUDER_MARKS"], "prestartup").touch()\n'


def shadow_tree(real: Path, at: Path) -> Path:
    """A ComfyUI tree at ``at`` that runs ``real``'s code with a custom_nodes folder of its own."""
    at.mkdir()
    for entry in real.iterdir():
        if entry.name == "custom_nodes":
            continue
        if entry.is_file() and entry.suffix == ".py":
            shutil.copy2(entry, at / entry.name)
        else:
            S.link(at / entry.name, entry)
    (at / "custom_nodes").mkdir()
    return at


def test_packs_already_in_comfyui_are_not_loaded(comfyui_path, tmp_path):
    tree = shadow_tree(comfyui_path, tmp_path / "ComfyUI")
    installed = tree / "custom_nodes"
    intruder = installed / "intruder_pack"
    (intruder / "web").mkdir(parents=True)
    (intruder / "__init__.py").write_text(INTRUDER)
    (intruder / "prestartup_script.py").write_text(PRESTARTUP)
    (intruder / "web" / "intruder.js").write_text("// another pack's web extension\n")
    for name in ("ComfyUI-UNet-Compiler", S.PACK_ROOT.name):   # the Manager's install, and one named as ours
        S.link(installed / name, S.PACK_ROOT)
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "checkpoints").mkdir()
    server = S.start_server(tmp_path / "server", tmp_path / "checkpoints", comfyui_path=tree,
                            extra_nodes={"unet_compiler_test_node": TEST_NODE},
                            env={"UNET_COMPILER_INTRUDER_MARKS": str(marks)}, log=lambda m: print("\n[e2e] " + m))
    try:
        info = server.object_info()
        extensions = server.get_json("/extensions")
    finally:
        server.stop()
    ours = f"custom_nodes.{server.pack_dir.name}"
    modules = {v.get("python_module") for v in info.values() if str(v.get("python_module")).startswith("custom_nodes.")}
    assert modules == {ours, "custom_nodes.unet_compiler_test_node"}, modules
    assert [n for n in info if n.startswith("UNetCompiler_")], "the pack's nodes are missing:\n" + server.log_tail()
    assert "UNetCompilerTest_Intruder" not in info
    # one copy of the pack's web extension (two would register "UNetCompiler.Feedback" twice in the browser)
    assert [e for e in extensions if e.endswith("/unet_compiler.js")] == [f"/extensions/{server.pack_dir.name}/unet_compiler.js"], \
        extensions
    assert not [e for e in extensions if "intruder" in e], extensions
    assert not list(marks.iterdir()), "the other pack ran: " + ", ".join(p.name for p in marks.iterdir())
    assert str(installed) not in server.log_tail(2_000_000), "the server looked into the tree's custom_nodes"
