"""KernelConfig: settings by name are validated (unknown names list the fields, wrong types and
ranges name the field), parse from ``NAME=VALUE`` text, and survive the manifest's JSON."""

from __future__ import annotations

import inspect
import json

import pytest

from kiln.kernels import KernelConfig
from kiln.kernels.config import DEFAULTS, KernelConfigError, parse_settings


def test_an_unknown_field_is_refused_with_the_valid_ones():
    with pytest.raises(KernelConfigError, match="no field 'decode_block'; fields: pdl, side_stream, decode_min_split_tokens"):
        DEFAULTS.with_settings({"decode_block": 32})
    with pytest.raises(TypeError):
        KernelConfig(decode_block=32)  # the constructor is no way around it


@pytest.mark.parametrize("settings,message", [
    ({"pdl": 1}, "pdl must be a bool"),
    ({"decode_block_n": "64"}, "decode_block_n must be a power of two"),
    ({"decode_block_n": 48}, "decode_block_n must be a power of two"),
    ({"decode_num_stages": 0}, "decode_num_stages must be an int >= 1"),
    ({"sample_chunk": 1.5}, "sample_chunk must be an int >= 1"),
    ({"argmax_programs_per_sm": True}, "argmax_programs_per_sm must be an int >= 1"),
    ({"gemv_block_k": (1024, 64)}, "gemv_block_k must be a pair \\(least, most\\)"),
    ({"gemv_block_n": 8}, "gemv_block_n must be a pair"),
    ({"gemv_block_n": (4, 6)}, "gemv_block_n must be a pair .* each a power of two"),
])
def test_wrong_types_and_ranges_are_refused(settings, message):
    with pytest.raises(KernelConfigError, match=message):
        DEFAULTS.with_settings(settings)


def test_zero_turns_off_what_may_be_off():
    config = DEFAULTS.with_settings({"decode_preload_max_programs_per_sm": 0, "gemv_max_weight_bytes": 0})
    assert config.changes() == {"decode_preload_max_programs_per_sm": 0, "gemv_max_weight_bytes": 0}


def test_settings_parse_from_text():
    settings = parse_settings(["gemv_block_k=(64, 2048)", "pdl=false", " decode_block_n = 32 "])
    assert settings == {"gemv_block_k": (64, 2048), "pdl": False, "decode_block_n": 32}
    assert DEFAULTS.with_settings(settings).changes() == settings
    with pytest.raises(KernelConfigError, match="is not NAME=VALUE"):
        parse_settings(["decode_block_n"])
    with pytest.raises(KernelConfigError, match="decode_block_n='sixty': the value is not a Python literal"):
        parse_settings(["decode_block_n=sixty"])


def test_json_round_trip_and_missing_fields_default():
    config = KernelConfig(pdl=False, gemv_block_n=(4, 4), sample_chunk=48)
    text = json.dumps(config.to_json())
    assert KernelConfig.from_json(json.loads(text)) == config
    assert KernelConfig.from_json({"sample_chunk": 48}) == KernelConfig(sample_chunk=48)
    with pytest.raises(KernelConfigError, match="no field 'retired_knob'"):
        KernelConfig.from_json({"retired_knob": 1})
    # A field kiln retired, as an older artifact's manifest records it, is dropped.
    assert KernelConfig.from_json({"moe_gemv_block_n": 32, "sample_chunk": 48}) == KernelConfig(sample_chunk=48)


def test_every_field_has_a_docstring():
    source = inspect.getsource(KernelConfig)
    for name in KernelConfig.field_names():
        after = source.split(f"\n    {name}: ", 1)[1].split("\n", 2)[1]
        assert after.strip().startswith('"""'), f"{name} has no docstring"
