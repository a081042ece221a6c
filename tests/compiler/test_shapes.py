"""compiler/shapes.py: the Warmup Shapes text (validated, naming the bad entry); the probe shapes
(compiler/warmup.py)."""
import pytest
import torch

from unet_compiler.compiler.shapes import (
    MAX_CONTEXT_TOKENS,
    MAX_ENTRIES,
    MAX_TEXT,
    Shape,
    ShapeError,
    activation_floor,
    check_context_tokens,
    check_frames,
    check_memory,
    first_level_channels,
    label_of,
    parse_shapes,
    validate_shapes_input,
)
from unet_compiler.compiler.warmup import probe_shapes

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
    ("1000000x64x64", "batch 1000000 must be between 1 and 64"),
    ("1x0x0", "width 0 must be between 64 and 8192 px"),
    ("1x64x100000", "height 100000 must be between 64 and 8192 px"),
    ("None", "not BxWxH"),       # a JSON null, as ComfyUI's STRING conversion hands it over
    ("['1x64x64']", "not BxWxH"),  # a list in {"__value__": [...]}, likewise
    ("1x832x480x0", "frames 0 must be between 1 and"),
    ("1x832x480x5000", "frames 5000 must be between 1 and"),
    ("1x832x480x33x2", "not BxWxH"),
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


def test_video_entries_carry_frames_and_name_them():
    """``BxWxHxF``: a video's frames; one frame is an image (the same entry as ``BxWxH``)."""
    assert parse_shapes("1x832x480x33, 2x64x64x1") == [Shape(1, 832, 480, 33), Shape(2, 64, 64)]
    assert Shape(1, 832, 480, 33).label == "1x832x480x33" and Shape(2, 64, 64).label == "2x64x64"
    # a call's latent named back in pixels and frames: Wan's 4 frames a latent frame, 8 px a cell
    assert label_of(torch.zeros(2, 16, 9, 60, 104), 8, 4) == "2x832x480x33"
    assert label_of(torch.zeros(1, 16, 1, 8, 8), 8, 4) == "1x64x64"          # one frame: an image
    assert label_of(torch.zeros(1, 16, 1, 8, 8)) == "1x64x64"                # Qwen-Image's 5-D image latent
    check_frames([Shape(1, 832, 480, 33)], video=True)
    with pytest.raises(ShapeError, match=r"entry 1x512x512x33 gives 33 video frames, but this model makes images.*"
                                         r"write it as 1x512x512"):
        check_frames([Shape(1, 64, 64), Shape(1, 512, 512, 33)], video=False)


def test_probe_shapes_cover_specialisations_generic_first():
    probes = probe_shapes([Shape(1, 64, 64), Shape(4, 1024, 1024)])
    assert probes[0] == Shape(2, 128, 192)
    assert {p.batch for p in probes} == {1, 2} and {p.width for p in probes} == {64, 128}
    assert probe_shapes([Shape(2, 512, 512)]) == [Shape(2, 128, 192)]


def test_a_video_boxs_probes_carry_its_fewest_frames():
    """Video entries (``BxWxHxF``): the probes take the fewest frames an entry gives, and their labels
    say so (a video model's probe is no one-frame image)."""
    probes = probe_shapes([Shape(1, 832, 480, 33), Shape(2, 832, 480, 81)])
    assert probes == [Shape(2, 128, 192, 33), Shape(1, 128, 192, 33)], probes
    assert probes[0].label == "2x128x192x33"
    assert probe_shapes([Shape(1, 64, 64), Shape(2, 128, 96, 9)])[0].label == "2x128x192x9"


def test_size_oblivious_code_needs_no_probe_per_small_side():
    box = [Shape(2, 64, 64), Shape(4, 128, 128)]
    assert probe_shapes(box) == [Shape(2, 128, 192), Shape(2, 128, 64), Shape(2, 64, 192), Shape(2, 64, 64)]
    # one small side is no class of its own; both small is (one token at the deepest level)
    assert probe_shapes(box, size_one_sides=False) == [Shape(2, 128, 192), Shape(2, 64, 64)]
    assert probe_shapes([Shape(1, 64, 512)], size_one_sides=False) == [Shape(1, 64, 192)]


def test_small_side_probes_follow_the_unets_depth():
    """A side is 1 at the deepest level only where ceil-halving the latent (levels - 1) times gets
    there: 64 px for SD1.5's 4 levels, no side at all for SDXL's 3 (64 px is 2 there)."""
    box = [Shape(1, 64, 64), Shape(2, 1024, 1024)]
    assert probe_shapes(box, levels=3) == [Shape(2, 128, 192), Shape(1, 128, 192)]
    assert probe_shapes([Shape(2, 72, 120)]) == [Shape(2, 128, 192)], "72-120 px are 2 at SD1.5's deepest level"
    five = probe_shapes([Shape(2, 64, 128), Shape(2, 512, 512)], levels=5)
    assert five[0] == Shape(2, 256, 384) and Shape(2, 64, 64) in five, five


# Sizes nobody can mean: each refused by the parser (before any tensor exists), with a short message.
HUGE = [
    ("1" * 4000 + "x64x64", "batch '111111111111…' must be between 1 and 64"),   # int() of 4000 digits: slow
    ("1" * 5000 + "x64x64", "5006 characters long, at most 4096"),   # int() of >4300 digits raised ValueError
    ("1x" + "9" * 30 + "x64", "width '999999999999…' must be between 64 and 8192 px"),
    ("1x64x64," * (MAX_ENTRIES + 1), f"{MAX_ENTRIES + 1} entries, at most {MAX_ENTRIES}"),
    ("x" * (MAX_TEXT + 1), f"{MAX_TEXT + 1} characters long, at most {MAX_TEXT}"),
    ("q" * 1000, "entry 'qqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqq…' is not BxWxH"),
]


@pytest.mark.parametrize("text,why", HUGE, ids=["4000_digit_batch", "5000_digit_batch", "30_digit_width", "too_many_entries",
                                                 "text_too_long", "long_garbage_entry"])
def test_absurd_shapes_refused_with_a_short_message(text, why):
    with pytest.raises(ShapeError) as e:
        parse_shapes(text)
    assert why in str(e.value)
    assert len(str(e.value)) < 300, "the message echoes the input"
    assert validate_shapes_input(text) == f"Warmup Shapes: {e.value}"


def test_linked_or_missing_shapes_pass_validation():
    """ComfyUI validates with None for an input linked from another node (its value exists only
    when the prompt runs; execute parses it then) and for a missing one (ComfyUI says so itself)."""
    assert validate_shapes_input(None) is True
    with pytest.raises(ShapeError, match="expected text"):
        parse_shapes(None)   # at execute a None is an error


@pytest.mark.parametrize("tokens,why", [(0, "between 1 and"), (-5, "between 1 and"),
                                        (MAX_CONTEXT_TOKENS + 1, "between 1 and"),
                                        (10 ** 9, "between 1 and"), ("77", "whole number"), (77.0, "whole number"),
                                        (True, "whole number"), (None, "whole number")])
def test_context_tokens_bounded(tokens, why):
    """Bounded at execute: a value linked from a PrimitiveInt skips ComfyUI's widget range check."""
    with pytest.raises(ShapeError, match=why) as e:
        check_context_tokens(tokens)
    assert "context_tokens" in str(e.value)
    assert check_context_tokens(77) == 77 and check_context_tokens(MAX_CONTEXT_TOKENS) == MAX_CONTEXT_TOKENS


def test_context_tokens_widget_max_is_the_bound():
    from unet_compiler.nodes import spec
    (tokens,) = [i for i in spec.WARMUP_SHAPES.inputs if i.name == "context_tokens"]
    assert tokens.widget["max"] == MAX_CONTEXT_TOKENS


def test_activation_floor_is_three_first_level_tensors():
    # SD1.5 at 1x512x512 fp32: 3 x 320 x 64 x 64 x 4 bytes
    assert activation_floor(Shape(1, 512, 512), 320, 4) == 3 * 320 * 64 * 64 * 4
    assert activation_floor(Shape(2, 1024, 512), 320, 2) == 3 * 2 * 320 * 64 * 128 * 2


def test_a_shape_no_memory_holds_is_refused_naming_entry_memory_and_fix():
    shapes = parse_shapes("1x512x512, 64x8192x8192")
    with pytest.raises(ShapeError) as e:
        check_memory(shapes, 320, 4, 24 * 2**30, "this machine")
    msg = str(e.value)
    assert msg.startswith("shapes: entry 64x8192x8192 needs at least 240.0 GiB of activations"), msg
    assert "this machine has 24.0 GiB for them" in msg and "smaller batch" in msg, msg
    check_memory(shapes[:1], 320, 4, 24 * 2**30, "this machine")           # 15 MiB: fine


def test_memory_check_skips_what_it_cannot_know():
    big = parse_shapes("64x8192x8192")
    check_memory(big, None, 4, 1, "x")          # not an SD UNet: no first-level width
    check_memory(big, 320, 4, None, "x")        # free memory unreadable
    check_memory(big, 320, 4, 0, "x")


def test_first_level_channels_of_both_layouts(tiny_unet):
    assert first_level_channels(tiny_unet()) == tiny_unet.config()["block_out_channels"][0]

    class Comfy(torch.nn.Module):
        model_channels = 320
    assert first_level_channels(Comfy()) == 320
    assert first_level_channels(torch.nn.Linear(2, 2)) is None


def test_library_warmup_refuses_before_compiling(tiny_unet, monkeypatch):
    from unet_compiler import compile_unet, warmup
    from unet_compiler.compiler import api
    monkeypatch.setattr(api, "device_free_bytes", lambda device: 2**20)     # 1 MiB free
    unet = compile_unet(tiny_unet(), backend="eager")
    with pytest.raises(ShapeError, match=r"entry 1x512x512 needs at least 2 MiB .* this machine has 1 MiB for them"):
        warmup(unet, "1x64x64, 1x512x512")   # without the check: runs, no error
    assert api.accelerator_of(unet).report.warmup == []                      # nothing ran


def test_free_gpu_memory_counts_what_torch_holds_reserved(monkeypatch):
    """The library path's memory check: memory torch's allocator holds reserved but unused is free to
    the next allocation (ComfyUI counts it so too); the driver's figure alone refused shapes that fit."""
    from unet_compiler.compiler import shapes as S
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 * gib, 24 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * gib)
    assert S.device_free_bytes(torch.device("cuda", 0)) == 7 * gib
