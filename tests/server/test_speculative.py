"""``kiln serve --speculative-algorithm ngram``, through the official openai client: greedy text
identical to the shared non-speculative server's, the verify steps and mean accepted length in the
response's usage (extension fields) and the native /generate's meta_info, the accepted length in
/metrics; a combination that cannot work ends the server at start-up with a message naming it."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from tests.server.harness import API_KEY, MODEL, ServerProcess, wait_metric

PROMPT = "Count from 1 to 40, separated by commas: 1, 2, 3, 4, 5, 6, 7, 8,"


@pytest.fixture(scope="module")
def spec_server(smollm2_artifact, tmp_path_factory):
    with ServerProcess(smollm2_artifact, tmp_path_factory.mktemp("spec") / "serve.log",
                            "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "4") as process:
        yield process


def test_greedy_completion_matches_and_usage_reports_acceptance(spec_server, client):
    spec_client = openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    ours = spec_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert ours.choices[0].text == plain.choices[0].text
    usage = ours.usage.model_extra
    assert usage["spec_verify_ct"] >= 1 and usage["spec_accept_length"] > 1
    # Every token after the first came from a verify step.
    assert usage["spec_verify_ct"] * usage["spec_accept_length"] == pytest.approx(ours.usage.completion_tokens - 1)
    assert "spec_verify_ct" not in (plain.usage.model_extra or {})
    native = httpx.post(f"{spec_server.url}/generate", headers=spec_server.headers, timeout=120, json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    assert native["meta_info"]["spec_verify_ct"] >= 1
    assert wait_metric(spec_server, "kiln_spec_mean_accept_length", lambda v: v > 1) > 1
    assert wait_metric(spec_server, "kiln_spec_verify_steps_total", lambda v: v > 0) > 0


def test_an_impossible_combination_is_refused_at_start(smollm2_artifact):
    done = subprocess.run([sys.executable, "-m", "kiln", "serve", str(smollm2_artifact), "--device", "cpu",
                           "--speculative-algorithm", "ngram", "--speculative-draft-model-path", "/nowhere"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "speculative_draft_model_path does not apply to speculative_algorithm 'ngram'" in done.stdout + done.stderr
