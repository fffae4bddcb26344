"""OpenAI response bodies: chat completions, completions and their stream chunks, logprobs, usage.

Plain dicts (JSON-ready) built from the tokenizer manager's ``SampleOutput``s; the routes decide
when to send them. ``Accumulator`` folds a stream's deltas into whole samples for non-streaming
responses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .tokenizer_manager import SampleOutput, TokenLogprob, Usage


def usage_body(usage: Usage) -> dict[str, Any]:
    body = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}
    return {**body, **spec_usage(usage)}


def spec_usage(usage: Usage) -> dict[str, Any]:
    """Speculative decoding's extension fields, when it ran: the verify steps (SGLang's meta_info
    ``spec_verify_ct``) and the mean tokens each gave (accepted drafts + the target's own token)."""
    if not usage.spec_verify_ct:
        return {}
    return {"spec_verify_ct": usage.spec_verify_ct,
            "spec_accept_length": usage.spec_verify_tokens / usage.spec_verify_ct}


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [
        {"token": _text(e.token_bytes), "logprob": e.logprob, "bytes": list(e.token_bytes),
         "top_logprobs": [{"token": _text(b), "logprob": lp, "bytes": list(b)} for _, b, lp in e.top]}
        for e in entries]}


def completion_logprobs(entries: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
    tokens, offsets, top = [], [], []
    for entry in entries:
        token = _text(entry.token_bytes)
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
        # The chosen token is always listed, as OpenAI does, even when it is not among the top k.
        alternatives = {_text(b): lp for _, b, lp in entry.top}
        alternatives.setdefault(token, entry.logprob)
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": top,
            "text_offset": offsets}


@dataclass
class Sample:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class Accumulator:
    """Whole samples, keyed by their choice index (prompt_index * n + index)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.samples: dict[int, Sample] = {}

    def choice_index(self, output: SampleOutput) -> int:
        return output.prompt_index * self.n + output.index

    def add(self, output: SampleOutput) -> Sample:
        sample = self.samples.setdefault(self.choice_index(output), Sample())
        sample.text += output.text
        sample.token_ids += output.token_ids
        sample.logprobs += output.logprobs
        if output.finish_reason is not None:
            sample.finish_reason = finish_reason(output.finish_reason)
        return sample

    def ordered(self) -> list[tuple[int, Sample]]:
        return sorted(self.samples.items())


def finish_reason(reason: str | None) -> str | None:
    # The engine says "abort" for a request cut short; OpenAI has no such reason and this only
    # reaches a client when the server stopped the request itself.
    return "stop" if reason == "abort" else reason


def chat_response(rid: str, created: int, model: str, acc: Accumulator, usage: Usage,
                  with_logprobs: bool) -> dict[str, Any]:
    choices = [{"index": i, "message": {"role": "assistant", "content": s.text},
                "logprobs": chat_logprobs(s.logprobs) if with_logprobs else None,
                "finish_reason": s.finish_reason} for i, s in acc.ordered()]
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage_body(usage)}


def completion_response(rid: str, created: int, model: str, acc: Accumulator, usage: Usage,
                        with_logprobs: bool) -> dict[str, Any]:
    choices = [{"index": i, "text": s.text,
                "logprobs": completion_logprobs(s.logprobs, 0) if with_logprobs else None,
                "finish_reason": s.finish_reason} for i, s in acc.ordered()]
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage_body(usage)}


def chunk(rid: str, obj: str, created: int, model: str, choices: list[dict[str, Any]],
          usage: Usage | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage_body(usage)
    return body


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = sse("[DONE]")
