"""The gRPC API of a real ``kiln serve --grpc-port`` (SmolLM2 on CPU), through a client whose stubs
are generated from kiln.proto here (as any client would build them), beside the HTTP API of the
same server: the same greedy text, errors as status codes, the key as ``authorization`` metadata."""

from __future__ import annotations

import importlib
import json
import sys

import httpx
import pytest

from tests.server.harness import API_KEY, MODEL, ServerProcess, free_port
from tests.server.grpc.test_proto import PACKAGE_ROOT, protoc

grpc = pytest.importorskip("grpc", reason="grpcio is not installed: run scripts/setup-env test")

AUTH = (("authorization", f"Bearer {API_KEY}"),)
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    """kiln.proto compiled into client modules in a fresh directory."""
    out = tmp_path_factory.mktemp("stubs")
    assert protoc.main(["protoc", f"-I{PACKAGE_ROOT / 'kiln/server/grpc'}", f"--python_out={out}",
                        f"--grpc_python_out={out}", str(PACKAGE_ROOT / "kiln/server/grpc/kiln.proto")]) == 0
    sys.path.insert(0, str(out))
    try:
        yield importlib.import_module("kiln_pb2"), importlib.import_module("kiln_pb2_grpc")
    finally:
        sys.path.remove(str(out))


@pytest.fixture(scope="module")
def grpc_server(smollm2_artifact, tmp_path_factory):
    port = free_port()
    with ServerProcess(smollm2_artifact, tmp_path_factory.mktemp("grpc") / "serve.log", "--grpc-port", str(port)) as process:
        yield process, port


@pytest.fixture(scope="module")
def stub(pb, grpc_server):
    _, pb_grpc = pb
    with grpc.insecure_channel(f"127.0.0.1:{grpc_server[1]}") as channel:
        yield pb_grpc.KilnStub(channel)


@pytest.fixture(scope="module")
def http(grpc_server):
    with httpx.Client(base_url=grpc_server[0].url, headers=grpc_server[0].headers, timeout=TIMEOUT_S) as session:
        yield session


def test_generate_and_chat_match_http_greedy_text(pb, stub, http):
    messages, _ = pb
    sampling = messages.SamplingParams(max_tokens=12, temperature=0)
    pieces = list(stub.Generate(messages.GenerateRequest(text="The capital of France is", sampling=sampling),
                                metadata=AUTH, timeout=TIMEOUT_S))
    assert pieces[-1].finish_reason == "length" and pieces[-1].usage.completion_tokens == 12
    http_text = http.post("/v1/completions", json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12,
                                                   "temperature": 0}).json()["choices"][0]["text"]
    assert "".join(p.text for p in pieces) == http_text

    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = stub.Chat(messages.ChatRequest(messages=[messages.ChatMessage(**m) for m in question],
                                          sampling=messages.SamplingParams(max_tokens=16, temperature=0)),
                     metadata=AUTH, timeout=TIMEOUT_S)
    http_chat = http.post("/v1/chat/completions", json={"messages": question, "max_tokens": 16, "temperature": 0}).json()
    assert chat.content == http_chat["choices"][0]["message"]["content"] and "Paris" in chat.content


def test_chat_with_a_named_tool(pb, stub):
    messages, _ = pb
    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    reply = stub.Chat(messages.ChatRequest(
        messages=[messages.ChatMessage(role="user", content="What is the weather in Paris?")],
        tools=[messages.Tool(name="get_weather", description="Get the weather", parameters=json.dumps(parameters))],
        function="get_weather", parallel_tool_calls=False,
        sampling=messages.SamplingParams(max_tokens=60, temperature=0)), metadata=AUTH, timeout=TIMEOUT_S)
    assert reply.finish_reason == "tool_calls" and len(reply.tool_calls) == 1
    assert reply.tool_calls[0].function.name == "get_weather"
    assert isinstance(json.loads(reply.tool_calls[0].function.arguments)["city"], str)


def test_tokenize_models_and_health(pb, stub, http):
    messages, _ = pb
    tokens = stub.Tokenize(messages.TokenizeRequest(text="Hello world"), metadata=AUTH).tokens
    assert list(tokens) == http.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert [m.id for m in stub.ListModels(messages.ListModelsRequest(), metadata=AUTH).models] == [MODEL]
    assert stub.Health(messages.HealthRequest()).status == "ok"  # no key needed


def test_bad_requests_get_status_codes_and_the_server_keeps_serving(pb, stub):
    messages, _ = pb
    cases = [
        (messages.GenerateRequest(text="Hi", sampling=messages.SamplingParams(temperature=-1)),
         grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (messages.GenerateRequest(text="Hi", model="other"), grpc.StatusCode.NOT_FOUND, "other"),
        (messages.GenerateRequest(sampling=messages.SamplingParams(max_tokens=1)), grpc.StatusCode.INVALID_ARGUMENT,
         "prompt"),
        (messages.GenerateRequest(text="Hi", sampling=messages.SamplingParams(max_tokens=100000)),
         grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ]
    for request, code, named in cases:
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(request, metadata=AUTH, timeout=TIMEOUT_S))
        assert error.value.code() == code and named in error.value.details(), error.value.details()
    with pytest.raises(grpc.RpcError) as error:
        stub.Chat(messages.ChatRequest(messages=[messages.ChatMessage(role="user", content="hi")],
                                       tools=[messages.Tool(name="f", parameters="{not json")]), metadata=AUTH)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools[0].parameters" in error.value.details()
    ok = list(stub.Generate(messages.GenerateRequest(text="Hi", sampling=messages.SamplingParams(max_tokens=2)),
                            metadata=AUTH, timeout=TIMEOUT_S))
    assert ok[-1].finish_reason in ("length", "stop")


def test_missing_or_wrong_key_is_unauthenticated(pb, stub):
    messages, _ = pb
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as error:
            stub.ListModels(messages.ListModelsRequest(), metadata=metadata)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(messages.GenerateRequest(text="Hi"), metadata=metadata))
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
