"""Fixtures for the server tests: SmolLM2 compiled once (fp32, torch backend, 2048-token context),
and one real ``kiln serve`` subprocess shared by every test module here that talks to a running
server (the lifecycle tests start their own short-lived ones)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.harness import API_KEY, ServerProcess


@pytest.fixture(scope="session")
def smollm2_artifact(smollm2_dir, tmp_path_factory):
    from kiln import compile as compile_model

    return compile_model(str(smollm2_dir), str(tmp_path_factory.mktemp("artifact") / "smollm2.kiln"),
                         dtype="fp32", backend="torch", max_seq_len=2048)


@pytest.fixture(scope="session")
def server(smollm2_artifact, tmp_path_factory):
    """The shared server: API key required, a 64 KiB body limit and at most 4 samples a request."""
    with ServerProcess(smollm2_artifact, tmp_path_factory.mktemp("serve") / "serve.log",
                            "--max-body-bytes", "65536", "--max-n", "4") as process:
        yield process


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as session:
        yield session
