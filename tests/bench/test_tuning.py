"""The benchmarks' compile variants: ``--kernel-config NAME=VALUE`` and ``--skip-pass NAME`` become
the compile's ``KernelConfig`` and skipped passes, and a typo is an error naming the valid fields."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from models import add_model_arguments  # noqa: E402

from kiln.cli_compile import tuning_options  # noqa: E402
from kiln.kernels import KernelConfig  # noqa: E402


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    return parser.parse_args(argv)


def test_settings_and_skipped_passes_go_into_the_compile():
    args = parse("--kernel-config", "decode_min_split_tokens=32", "--kernel-config", "pdl=false",
                 "--skip-pass", "fuse_rope_attention")
    assert tuning_options(args) == {"kernel_config": KernelConfig(decode_min_split_tokens=32, pdl=False),
                                    "skip_passes": ("fuse_rope_attention",)}
    assert tuning_options(parse()) == {"kernel_config": KernelConfig(), "skip_passes": ()}


@pytest.mark.parametrize("argv,message", [
    (("--kernel-config", "min_split_tokens=32"), "no field 'min_split_tokens'; fields: pdl, side_stream, decode_min_split_tokens"),
    (("--kernel-config", "decode_block_n=48"), "decode_block_n must be a power of two"),
    (("--kernel-config", "decode_block_n"), "is not NAME=VALUE"),
    (("--skip-pass", "plan_memory"), "cannot skip plan_memory: every artifact needs it"),
])
def test_a_typo_is_an_error_naming_what_exists(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert message in capsys.readouterr().err

