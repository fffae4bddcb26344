"""OpenAI response bodies: chat completions, completions and their stream chunks, logprobs, usage.

Plain dicts (JSON-ready) built from the tokenizer manager's ``SampleOutput``s; the routes decide
when to send them. Each choice carries SGLang's ``matched_stop`` beside its finish reason: the stop
string or stop regex pattern that ended it, the stop token id (EOS among them), or null. ``Accumulator`` folds a stream's deltas into whole samples for non-streaming
responses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kiln import __version__

from .request_stream import PromptEcho, SampleOutput, TokenLogprob, Usage

# OpenAI's system_fingerprint names the backend configuration that answered; clients compare it
# to tell whether answers may differ for reasons other than sampling.
SYSTEM_FINGERPRINT = f"kiln-{__version__}"


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


def completion_logprobs(entries: list[TokenLogprob], text_offset: int, echo: PromptEcho | None = None,
                        prompt_logprobs: list[float] = ()) -> dict[str, Any]:
    """OpenAI's completion logprobs; with ``echo``, the prompt's tokens lead, the first scored None
    (nothing precedes it) and the others by ``prompt_logprobs``."""
    tokens: list[str] = []
    offsets: list[int] = []
    values: list[float | None] = []
    top: list[dict[str, float] | None] = []
    if echo is not None:
        for position, data in enumerate(echo.token_bytes):
            token = _text(data)
            value = prompt_logprobs[position - 1] if 0 < position <= len(prompt_logprobs) else None
            tokens.append(token)
            offsets.append(text_offset)
            text_offset += len(token)
            values.append(value)
            top.append(None if value is None else {token: value})
    for entry in entries:
        token = _text(entry.token_bytes)
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
        # The chosen token is always listed, as OpenAI does, even when it is not among the top k.
        alternatives = {_text(b): lp for _, b, lp in entry.top}
        alternatives.setdefault(token, entry.logprob)
        top.append(alternatives)
    values += [e.logprob for e in entries]
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top, "text_offset": offsets}


@dataclass
class Sample:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[float] = field(default_factory=list)
    matched_stop: int | str | None = None


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
        sample.prompt_logprobs += output.prompt_logprobs
        if output.finish_reason is not None:
            sample.finish_reason = finish_reason(output.finish_reason)
            sample.matched_stop = output.matched_stop
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
                "finish_reason": s.finish_reason, "matched_stop": s.matched_stop} for i, s in acc.ordered()]
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage_body(usage), "system_fingerprint": SYSTEM_FINGERPRINT}


def completion_response(rid: str, created: int, model: str, acc: Accumulator, usage: Usage,
                        with_logprobs: bool, echoes: list[PromptEcho] | None = None,
                        keep_generated: bool = True) -> dict[str, Any]:
    """``echoes``: each prompt's echo (``echo``); ``keep_generated`` False drops the one token a
    ``max_tokens`` 0 request generated (it ran only to score the prompt)."""
    choices = []
    for i, s in acc.ordered():
        echo = echoes[i // acc.n] if echoes else None
        entries = s.logprobs if keep_generated else []
        text = (echo.text if echo else "") + (s.text if keep_generated else "")
        choices.append({"index": i, "text": text,
                        "logprobs": completion_logprobs(entries, 0, echo, s.prompt_logprobs) if with_logprobs else None,
                        "finish_reason": s.finish_reason if keep_generated else "length",
                        "matched_stop": s.matched_stop if keep_generated else None})
    if not keep_generated:
        usage = Usage(usage.prompt_tokens, 0, usage.cached_tokens)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage_body(usage), "system_fingerprint": SYSTEM_FINGERPRINT}


def chunk(rid: str, obj: str, created: int, model: str, choices: list[dict[str, Any]],
          usage: Usage | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
                            "system_fingerprint": SYSTEM_FINGERPRINT}
    if usage is not None:
        body["usage"] = usage_body(usage)
    return body


class ChunkFrames:
    """The SSE frames of one stream's chunks. A stream sends one chunk per token, and only its choices
    change: the fields every chunk repeats (id, object, created, model, system_fingerprint) are
    serialized once here, and each frame serializes just its choices (the same JSON as
    ``sse(chunk(...))``, the choices moved last)."""

    def __init__(self, rid: str, obj: str, created: int, model: str) -> None:
        self.rid, self.obj, self.created, self.model = rid, obj, created, model
        head = json.dumps({"id": rid, "object": obj, "created": created, "model": model,
                           "system_fingerprint": SYSTEM_FINGERPRINT}, ensure_ascii=False)
        self._head = f"data: {head[:-1]}, \"choices\": ["

    def frame(self, *choices: dict[str, Any]) -> str:
        return self._head + ", ".join(json.dumps(c, ensure_ascii=False) for c in choices) + "]}\n\n"

    def usage_frame(self, usage: Usage) -> str:
        return sse(chunk(self.rid, self.obj, self.created, self.model, [], usage))


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = sse("[DONE]")
