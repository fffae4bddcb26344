"""Request schemas (pydantic) for the OpenAI-compatible and native endpoints, and their sampling
parameters.

Field ranges that do not depend on the model are checked here, so FastAPI reports them as 400s
naming the field; checks that need the model (vocabulary, context length) are the tokenizer
manager's. Besides OpenAI's fields, chat and completion requests take a few common extensions
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, SGLang's ``stop_regex``), as vLLM and SGLang do. Unknown fields are ignored, as OpenAI clients send
some (``user``, ``service_tier``) that do not change generation.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from kiln.runtime.sampling import SamplingParams
from kiln.runtime.sampling.params import MAX_TOP_LOGPROBS

from .errors import invalid
from .tools.protocol import ToolFields


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's structured-output request: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema(self) -> dict[str, Any] | None:
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema":
            if self.json_schema is None:
                raise invalid("response_format", "response_format: type json_schema needs a json_schema object")
            return self.json_schema.schema_
        return None


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, tool_call_id) pass through to the chat template.
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None


class Bootstrap(BaseModel):
    """SGLang's disaggregation fields, which ``kiln router --pd-disaggregation`` adds: the prefill server's
    bootstrap address and the room that pairs its prefill with the decode server's request."""

    bootstrap_host: str | None = None
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    bootstrap_room: int | None = Field(None, ge=0)

    def bootstrap(self) -> dict[str, Any] | None:
        if self.bootstrap_room is None:
            return None
        if self.bootstrap_host is None or self.bootstrap_port is None:
            raise invalid("bootstrap_room", "bootstrap_room: needs bootstrap_host and bootstrap_port too")
        return {"room": self.bootstrap_room, "host": self.bootstrap_host, "port": self.bootstrap_port}


class _Sampling(Bootstrap):
    """What chat and completion requests share."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extensions.
    top_k: int = -1
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    stop_regex: Union[str, list[str], None] = None
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    # Constraints beyond OpenAI's, as SGLang takes them.
    regex: str | None = None
    ebnf: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_new_tokens: int, logprobs: bool, top_logprobs: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, seed=self.seed, stop=_stop_list(self.stop),
            stop_regex=_stop_list(self.stop_regex),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, logprobs=logprobs,
            top_logprobs=top_logprobs, n=self.n, logit_bias=_token_bias(self.logit_bias),
            skip_special_tokens=self.skip_special_tokens,
            json_schema=self.response_format.schema() if self.response_format else None,
            regex=self.regex, ebnf=self.ebnf)


class ChatCompletionRequest(_Sampling, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_new_tokens: int) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs", "top_logprobs requires logprobs to be true")
        return self.sampling_params(max_new_tokens, self.logprobs, self.top_logprobs or 0)


Prompt = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    # OpenAI's default for completions; 0 only with echo (score the prompt, generate nothing).
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a list of prompts (each text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise invalid("prompt", "prompt must not be empty")
        return list(prompt)

    @property
    def generated_tokens(self) -> int:
        """Tokens the engine generates: max_tokens 0 (echo alone) still runs one step, whose token
        is dropped, since that step is what computes the prompt's logprobs."""
        return max(1, self.max_tokens)

    def to_sampling_params(self, max_new_tokens: int) -> SamplingParams:
        if self.max_tokens == 0 and not self.echo:
            raise invalid("max_tokens", "max_tokens: 0 is allowed only with echo (to score the prompt)")
        if self.echo and self.logprobs is not None and self.n != 1:
            raise invalid("n", "n must be 1 with echo and logprobs (the prompt is scored once)")
        if self.suffix:
            raise invalid("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise invalid("best_of", "best_of must equal n (ranking extra samples is not supported)")
        params = self.sampling_params(max_new_tokens, self.logprobs is not None, self.logprobs or 0)
        params.prompt_logprobs = self.echo and self.logprobs is not None
        return params


class GenerateRequest(Bootstrap):
    """The native endpoint: text or token ids, and ``SamplingParams`` fields as they are."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False

    def to_sampling_params(self) -> SamplingParams:
        try:
            return SamplingParams(**self.sampling_params)
        except TypeError as exc:  # an unknown field name
            raise invalid("sampling_params", f"sampling_params: {exc}") from None


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them. "developer" is OpenAI's newer name for the system turn;
    templates know "system"."""
    rendered = []
    for message in messages:
        data = message.model_dump(exclude_none=True)
        if data["role"] == "developer":
            data["role"] = "system"
        rendered.append(data)
    return rendered


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _token_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias has token ids as JSON object keys (strings)."""
    result: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            result[int(key)] = value
        except ValueError:
            raise invalid("logit_bias", f"logit_bias key {key!r} is not a token id") from None
    return result
