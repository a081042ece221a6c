"""End-to-end fixtures: a random-weight SD1.5 checkpoint and a headless ComfyUI.

Nothing here imports ComfyUI into the pytest process: the server and the checkpoint builder
are the package's ``comfy_server`` (subprocesses running ComfyUI's own code), shared with the
starts benchmark.

Environment:

- ``COMFYUI_PATH``: a ComfyUI source tree (the folder holding ``main.py``).
  Falls back to ``~/comfy/ComfyUI``. If neither exists every e2e test skips.
- ``UNET_COMPILER_TEST_CACHE``: a folder in which the random checkpoint is
  kept between sessions (built once, reused while present). Without it the
  checkpoint lives in the session's temp dir and is rebuilt every session.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from unet_compiler.bench import comfy_server as S
from unet_compiler.bench.comfy_server import CHECKPOINT_NAME, PromptFailed, fetch_image, run_prompt  # noqa: F401 - the tests' helpers

TEST_NODE = Path(__file__).resolve().parent / "comfy_test_node"


def pytest_configure(config):
    # pyproject.toml may register it too; add it only where nobody has.
    if not any(str(line).split(":", 1)[0].strip() == "e2e" for line in config.getini("markers")):
        config.addinivalue_line(
            "markers",
            "e2e: end-to-end test that starts a headless ComfyUI server "
            "(slow; deselect with -m 'not e2e')",
        )


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.e2e)
    # the soak last: it leaves the session's server holding a LoRA'd, range-warmed model, and the
    # servers other tests start beside that one must still fit in memory
    items.sort(key=lambda item: Path(item.path).name == "test_soak.py")


def pytest_pycollect_makemodule(module_path, parent):
    # Without ComfyUI (or its requirements in this env), skip each e2e module at collection: one
    # "SKIPPED" line for the lot instead of one per test, and no fixture ever runs.
    problem = comfy_problem()
    if problem:
        raise pytest.skip.Exception(problem, allow_module_level=True)
    return None


def comfy_problem() -> str | None:
    """Why there is no ComfyUI to test against here (one line), or None."""
    from unet_compiler.tests._families import comfy_problem
    return comfy_problem()


def find_comfyui() -> Path | None:
    """The ComfyUI tree to test against, or None when there is none (or it cannot run here)."""
    from unet_compiler.tests._families import comfy_path
    path = comfy_path()
    return path.resolve() if path and comfy_problem() is None else None


@pytest.fixture(scope="session")
def comfyui_path() -> Path:
    path = find_comfyui()
    if path is None:
        pytest.skip(comfy_problem())
    return path


# --------------------------------------------------------------------------
# Random-weight SD1.5 checkpoint and the server
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def sd15_checkpoint(comfyui_path, tmp_path_factory):
    """Path to a random-weight SD1.5 .safetensors that CheckpointLoaderSimple loads."""
    cache = os.environ.get("UNET_COMPILER_TEST_CACHE")
    if cache:
        yield S.checkpoint_path(Path(cache))
        return
    ckpt = tmp_path_factory.mktemp("checkpoints") / CHECKPOINT_NAME
    S.build_checkpoint(comfyui_path, ckpt)
    yield ckpt
    # pytest keeps the last few temp dirs; do not leave 2.5 GB in each.
    ckpt.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def comfy_server(comfyui_path, sd15_checkpoint, tmp_path_factory):
    """A headless ComfyUI with this checkout as a custom node, the test-only node that registers
    an IPAdapter-style attn2 replace (tests/e2e/comfy_test_node) and the random checkpoint."""
    server = S.start_server(tmp_path_factory.mktemp("comfy_server"), sd15_checkpoint.parent,
                            extra_nodes={"unet_compiler_test_node": TEST_NODE}, comfyui_path=comfyui_path,
                            log=lambda m: print("\n[e2e] " + m))
    try:
        yield server
    finally:
        server.stop()


# --------------------------------------------------------------------------
# Random-weight LoRA, ControlNet and T2I-Adapter for the SD1.5 checkpoint
# --------------------------------------------------------------------------

@pytest.fixture(scope="session")
def patch_asset_files(comfyui_path, sd15_checkpoint):
    """{"lora" / "controlnet" / "t2i": path} of a random LoRA, ControlNet and T2I-Adapter for the
    SD1.5 checkpoint (``comfy_server.patch_assets``: built beside the checkpoint, kept where it is
    kept). ``link_patch_assets`` puts them in a server's folders."""
    paths = S.patch_assets(sd15_checkpoint, log=lambda m: print("\n[e2e] " + m))
    yield paths
    if not os.environ.get("UNET_COMPILER_TEST_CACHE"):
        for p in paths.values():
            p.unlink(missing_ok=True)


def link_patch_assets(server, paths: dict) -> dict:
    """Link ``patch_asset_files`` into ``server``'s loras / controlnet folders; returns their names."""
    for kind, path in paths.items():
        link = server.model_dirs["loras" if kind == "lora" else "controlnet"] / path.name
        if not link.exists():
            S.link(link, path)
    return {k: p.name for k, p in paths.items()}


@pytest.fixture(scope="session")
def patch_assets(patch_asset_files, comfy_server):
    """The random LoRA, ControlNet and T2I-Adapter in the session server's loras / controlnet
    folders: {"lora" / "controlnet" / "t2i": file name}."""
    return link_patch_assets(comfy_server, patch_asset_files)


def compile_and_warm(p: dict, model: list, shapes: str) -> list:
    """Compile UNet (node "60") and Warmup Shapes (node "61", ``shapes``, 77 tokens, foreground) on
    ``model`` in the API prompt ``p``; returns the warmed model's link."""
    p["60"] = {"class_type": "UNetCompiler_CompileUNet", "inputs": {"model": model}}
    p["61"] = {"class_type": "UNetCompiler_WarmupShapes",
               "inputs": {"model": ["60", 0], "shapes": shapes, "context_tokens": 77, "background": False}}
    return ["61", 0]


def with_the_pack(p: dict, model: list, patch, order: str | None, shapes: str) -> None:
    """Wire the sampler (node "5") of the API prompt ``p`` to ``model`` through ``patch`` (a function
    that adds another pack's node on a model link and returns its output link) and this pack's
    nodes in ``order``: None (``patch`` alone: plain ComfyUI), "before" (Compile UNet + Warmup Shapes
    of ``shapes``, then ``patch``) or "after" (``patch``, then the pack's nodes); with the pack, the
    test node's report after sampling (node "62")."""
    if order == "before":
        model = patch(compile_and_warm(p, model, shapes))
    elif order == "after":
        model = compile_and_warm(p, patch(model), shapes)
    else:
        model = patch(model)
    p["5"]["inputs"]["model"] = model
    if order is not None:
        p["62"] = {"class_type": "UNetCompilerTest_Report", "inputs": {"model": model, "samples": ["5", 0]}}
