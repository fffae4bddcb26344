"""Bad input gets OpenAI's error shape with the right status, names the parameter, says not to
retry, and leaves the server serving everyone else."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.harness import API_KEY, MODEL

HI = [{"role": "user", "content": "hi"}]

BAD_CHAT = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"n": 5}, "n"),  # above the server's --max-n 4
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"logit_bias": {"49152": 5}}, "logit_bias"),  # SmolLM2's vocabulary is 0..49151
    ({"logit_bias": {"not-a-token": 5}}, "logit_bias"),
    ({"max_tokens": 2040}, "max_tokens"),  # prompt + max_tokens beyond the 2048-token context
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"temperature": "hot"}, "temperature"),
    ({"stop": 7}, "stop"),
    ({"seed": 2**70}, "seed"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
]


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert isinstance(error["code"], str) and error["code"], "every error has a stable code"
    if param is not None:
        assert error["param"] == param and param.split("[")[0].split(".")[0] in error["message"]
    if status < 500:
        assert response.headers["x-should-retry"] == "false"
    return error


@pytest.mark.parametrize("change,param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_invalid_chat_parameters_are_400s_naming_the_parameter(http, change, param):
    body = {"model": MODEL, "messages": HI, "max_tokens": 4, **change}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 4}, "prompt"),  # missing
    ({"prompt": [], "max_tokens": 4}, "prompt"),
    ({"prompt": [49152], "max_tokens": 4}, "prompt"),  # token id outside the vocabulary
    ({"prompt": "hi", "max_tokens": 4, "logprobs": 99}, "logprobs"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"prompt": "hi", "max_tokens": 4, "echo": True, "stream": True}, "echo"),
])
def test_invalid_completion_requests(http, body, param):
    assert_error(http.post("/v1/completions", json={"model": MODEL, **body}), 400, param)


def test_native_generate_rejects_unknown_and_invalid_sampling_params(http):
    assert_error(http.post("/generate", json={"text": "hi", "sampling_params": {"bogus": 1}}), 400, "sampling_params")
    assert_error(http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 0}}), 400,
                 "max_new_tokens")
    assert_error(http.post("/generate", json={"sampling_params": {}}), 400, "text")


def test_malformed_json_is_a_400(http):
    response = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(response, 400)


def test_unknown_model_is_a_404(http, client):
    error = assert_error(http.post("/v1/chat/completions", json={"model": "gpt-4", "messages": HI}), 404, "model")
    assert error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=HI, max_tokens=2)


def test_missing_or_wrong_api_key_is_a_401(server):
    body = {"model": MODEL, "messages": HI, "max_tokens": 2}
    assert_error(httpx.post(f"{server.url}/v1/chat/completions", json=body), 401)
    assert_error(httpx.post(f"{server.url}/v1/chat/completions", json=body,
                            headers={"Authorization": "Bearer wrong-key"}), 401)
    assert_error(httpx.get(f"{server.url}/metrics", headers={"Authorization": API_KEY}), 401)  # no Bearer
    assert httpx.get(f"{server.url}/health").status_code == 200  # exempt
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_oversized_bodies_are_413(http):
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 70000}]}
    assert_error(http.post("/v1/chat/completions", json=big), 413)

    def chunks():  # no Content-Length: the limit must hold on the streamed body too
        yield b'{"model": "smol", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"y" * 1000
        yield b'"}]}'

    assert_error(http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}),
                 413)


def test_unknown_route_is_a_404_in_the_same_shape(http):
    assert_error(http.get("/v1/nothing-here"), 404)


def test_server_still_serves_after_bad_requests(client, http):
    for change, _ in BAD_CHAT[:6]:
        http.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 4, **change})
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content":
                                              "What is the capital of France?"}], temperature=0, max_tokens=12)
    assert "Paris" in response.choices[0].message.content
    assert http.get("/health").status_code == 200
