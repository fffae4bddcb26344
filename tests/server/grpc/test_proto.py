"""The checked-in generated modules are what grpcio-tools makes of kiln.proto today."""

from __future__ import annotations

from pathlib import Path

import pytest

import kiln

# grpcio-tools is a test dependency (pyproject's [test] extra; scripts/setup-env test installs it).
protoc = pytest.importorskip("grpc_tools.protoc", reason="grpcio-tools is not installed: run scripts/setup-env test")

PACKAGE_ROOT = Path(kiln.__file__).parent.parent
GENERATED = ("kiln_pb2.py", "kiln_pb2_grpc.py")


def test_generated_modules_match_the_proto(tmp_path):
    status = protoc.main(["protoc", f"-I{PACKAGE_ROOT}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                          str(PACKAGE_ROOT / "kiln/server/grpc/kiln.proto")])
    assert status == 0
    for name in GENERATED:
        fresh = (tmp_path / "kiln/server/grpc" / name).read_text()
        assert fresh == (PACKAGE_ROOT / "kiln/server/grpc" / name).read_text(), (
            f"{name} is stale: regenerate it (see the command at the top of kiln.proto)")
