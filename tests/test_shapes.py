"""compiler/shapes.py: the Warmup Shapes text (validated, naming the bad entry) and the probe shapes."""
import pytest

from unet_compiler.compiler.shapes import (
    MAX_CONTEXT_TOKENS,
    MAX_ENTRIES,
    MAX_TEXT,
    Shape,
    ShapeError,
    check_context_tokens,
    parse_shapes,
    probe_shapes,
    validate_shapes_input,
)

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
