"""compiler/shapes.py: the Warmup Shapes text (validated, naming the bad entry) and the probe shapes."""
import pytest

from unet_compiler.compiler.shapes import Shape, ShapeError, parse_shapes, probe_shapes, validate_shapes_input

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
