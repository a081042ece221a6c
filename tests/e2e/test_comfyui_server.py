"""End-to-end: the pack inside a real, headless ComfyUI, driven over its HTTP API.

Both tests run the same txt2img graph on a random-weight SD1.5 checkpoint
(64x64, 2 euler steps, seed 0); the second inserts the pack's nodes before
KSampler and must give the same image as plain ComfyUI.

Run: pytest tests/e2e -q --import-mode=importlib   (select/deselect with -m e2e)
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.e2e

SEED = 0
SIZE = 64
PACK_NODES = (
    "UNetCompiler_SelectBackend",
    "UNetCompiler_CompileUNet",
    "UNetCompiler_WarmupShapes",
)
# Compiled vs eager, on uint8 pixels (2 = 2/255 of full scale). A stand-in
# fp32 torch.compile(inductor) of the whole UNet measured mean 0.001, max 1
# here; the margin leaves room for reduced-precision kernels, not for errors.
MAX_MEAN_ABS_DIFF = 2.0
MAX_ABS_DIFF = 24
# Warmup request as the WarmupShapes node spells it: batch x height x width.
WARMUP_SHAPES = f"1x{SIZE}x{SIZE}"


def txt2img_prompt(ckpt_name: str, filename_prefix: str, model_ref=("1", 0)) -> dict:
    """API-format CheckpointLoaderSimple -> CLIPTextEncode x2 -> KSampler -> VAEDecode -> SaveImage."""
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt_name}},
        "2": {"class_type": "CLIPTextEncode",
              "inputs": {"text": "a photograph of a red fox in the snow", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode",
              "inputs": {"text": "blurry, low quality", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage",
              "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
        "5": {"class_type": "KSampler",
              "inputs": {"model": list(model_ref), "seed": SEED, "steps": 2, "cfg": 7.0,
                         "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0,
                         "positive": ["2", 0], "negative": ["3", 0],
                         "latent_image": ["4", 0]}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": "SaveImage",
              "inputs": {"images": ["6", 0], "filename_prefix": filename_prefix}},
    }


def output_images(entry: dict) -> list[dict]:
    """The {filename, subfolder, type} records of every image in a history entry."""
    images = []
    for node_out in (entry.get("outputs") or {}).values():
        images.extend(node_out.get("images") or [])
    return images


def the_image(server, entry) -> np.ndarray:
    images = output_images(entry)
    assert len(images) == 1, f"expected one output image, history outputs: {entry.get('outputs')}"
    img = server.fetch_image(images[0])
    assert (server.output_dir / images[0].get("subfolder", "") / images[0]["filename"]).is_file()
    return img


def ui_text(entry: dict, node_id: str) -> str:
    """The UI text a node returned (V1 {"ui": {"text": ...}} / V3 ui.PreviewText)."""
    out = (entry.get("outputs") or {}).get(node_id) or {}
    text = out.get("text")
    if text is None:
        return ""
    if isinstance(text, (list, tuple)):
        return "\n".join(str(t) for t in text)
    return str(text)


@pytest.fixture(scope="session")
def eager_result(comfy_server, sd15_checkpoint):
    t0 = time.time()
    entry = comfy_server.run_prompt(txt2img_prompt(sd15_checkpoint.name, "e2e_eager"),
                                   timeout=300)
    img = the_image(comfy_server, entry)
    print(f"\n[e2e] eager txt2img prompt: {time.time() - t0:.1f} s")
    return img


def test_eager_txt2img(eager_result):
    img = eager_result
    assert img.shape == (SIZE, SIZE, 3), img.shape
    assert img.dtype == np.uint8
    f = img.astype(np.float64)
    assert np.isfinite(f).all()
    assert f.std() > 1.0, f"image is (nearly) constant: mean {f.mean():.1f}, std {f.std():.2f}"
    assert len(np.unique(img)) > 16, "image has too few distinct values"


def test_compiled_matches_eager(comfy_server, sd15_checkpoint, request):
    info = comfy_server.object_info()
    missing = [n for n in PACK_NODES if n not in info]
    if missing:
        pytest.fail(
            f"UNet Compiler nodes missing from /object_info: {missing}. ComfyUI loaded "
            f"the pack from {comfy_server.pack_dir} -> {comfy_server.pack_dir.resolve()}; "
            "what its log says about that import:\n" + comfy_server.pack_import_report(),
            pytrace=False,
        )

    # Only now (nodes present) pay for the eager reference run, if test (a) did not.
    eager = request.getfixturevalue("eager_result")

    prompt = txt2img_prompt(sd15_checkpoint.name, "e2e_compiled", model_ref=("12", 0))
    prompt["10"] = {"class_type": "UNetCompiler_SelectBackend",
                    "inputs": {"backend": "inductor", "precision": "auto",
                               "dynamic_shapes": True}}
    prompt["11"] = {"class_type": "UNetCompiler_CompileUNet",
                    "inputs": {"model": ["1", 0], "backend": ["10", 0]}}
    prompt["12"] = {"class_type": "UNetCompiler_WarmupShapes",
                    "inputs": {"model": ["11", 0], "shapes": WARMUP_SHAPES,
                               "context_tokens": 77}}

    t0 = time.time()
    entry = comfy_server.run_prompt(prompt, timeout=900)
    print(f"\n[e2e] compiled txt2img prompt (compile + warmup + sample): {time.time() - t0:.1f} s")

    report = ui_text(entry, "11")
    assert report, (
        "CompileUNet returned no UI text in /history "
        f"(outputs: {entry.get('outputs', {}).get('11')})"
    )
    assert "inductor" in report.lower(), f"CompileUNet report does not name the backend: {report!r}"

    compiled = the_image(comfy_server, entry)
    assert compiled.shape == eager.shape
    diff = np.abs(compiled.astype(np.int16) - eager.astype(np.int16))
    print(f"[e2e] compiled vs eager: mean abs diff {diff.mean():.4f}/255, max {diff.max()}/255")
    assert diff.mean() <= MAX_MEAN_ABS_DIFF and diff.max() <= MAX_ABS_DIFF, (
        f"compiled image differs from eager: mean abs {diff.mean():.3f}/255, "
        f"max abs {diff.max()}/255; CompileUNet report: {report!r}; "
        f"WarmupShapes report: {ui_text(entry, '12')!r}"
    )
