"""The HTTP process's side of generation: tokenization, chat templates, validation, and the
bookkeeping of requests in flight.

A route turns its body into prompt token ids and ``SamplingParams``, checks them (``check``) and
calls ``submit``, which sends one ADD per prompt to the scheduler process and returns a
``RequestStream``; with several data-parallel replicas the ``CacheAwareRouter`` picks each
prompt's replica (an ABORT goes to the same one). The receive loop (``dispatch``) routes the
detokenizer's OUTPUTS to their streams and records latency metrics. Closing a stream before it
finished (the client went away, an error) aborts what is left, so the scheduler frees its KV at once.

With a queue limit (``kiln serve --max-queued-requests N``, SGLang's name), a submission that would
leave more than N samples queued -- in flight beyond what the engines run at once, the replicas'
``max_running`` together -- is refused with 503 and ``Retry-After`` before anything is sent: the
count is the API servers' own (``SamplesInFlight``, shared by all of them), exact at once, where the
schedulers' published queue lengths lag.

With several API servers (``--api-server-count``) each HTTP process has its own tokenizer manager;
each ADD names its ``api_server`` (``AddOptions.origin``), so its outputs come back to this one.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import zmq
import zmq.asyncio

from kiln.runtime.outputs import INTERNAL_ERROR
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.text.token_bytes import TokenBytes
from kiln.runtime.text.tokenizer import Tokenizer

from . import ipc
from .errors import APIError, from_value_error, invalid
from .in_flight import SamplesInFlight
from .metrics import ServerMetrics
from .request_stream import PromptEcho, RequestStream, SampleOutput, TokenLogprob
from .router import CacheAwareRouter

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a request the context cannot hold
QUEUE_FULL = "queue_full"
# What a refused client is told to wait: about the time a batch of short requests takes to move on.
QUEUE_RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ModelInfo:
    name: str
    vocab_size: int
    max_seq_len: int
    created: int
    max_running: int = 0  # samples the engines run at once, all replicas together


@dataclass(frozen=True)
class Admission:
    """How many samples may wait beyond those running (``--max-queued-requests``); None: no limit."""

    max_queued_requests: int | None = None

    def validate(self) -> None:
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")


@dataclass
class _Live:
    """A request in flight (one prompt, its n samples)."""

    stream: "RequestStream"
    prompt_index: int
    samples: int  # its n
    arrival: float
    replica: int
    last_token_at: dict[int, float] = field(default_factory=dict)
    open_samples: int = field(init=False)

    def __post_init__(self) -> None:
        self.open_samples = self.samples


class TokenizerManager:
    def __init__(self, tokenizer: Tokenizer | None, info: ModelInfo, senders: list[zmq.Socket], metrics: ServerMetrics,
                 on_fatal: Callable[[str], None], router: CacheAwareRouter, admission: Admission = Admission(),
                 api_server: int = 0, samples_in_flight: SamplesInFlight | None = None) -> None:
        """``senders``: one socket per replica's scheduler, in replica order; ``router`` chooses among them.
        ``api_server``: this HTTP process's index; ``samples_in_flight``: the server's count (default: its own)."""
        self.tokenizer = tokenizer
        self.info = info
        self.metrics = metrics
        self.admission = admission
        self.api_server = api_server
        self._samples_in_flight = samples_in_flight or SamplesInFlight()
        self._senders = senders
        self._router = router
        self._on_fatal = on_fatal
        self._live: dict[str, _Live] = {}
        self.failure: str | None = None
        self.token_bytes = tokenizer.token_bytes if tokenizer is not None else TokenBytes(None)

    # ---- prompts -------------------------------------------------------------------------------

    # Tokenizing and rendering run in a worker thread: a prompt of megabytes must not stall the
    # event loop (the Rust tokenizer is thread-safe and releases the GIL).

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise invalid(param, f"{param}: this model has no tokenizer; send token ids")
        try:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)
        except ValueError as exc:  # not valid Unicode
            raise invalid(param, f"{param}: {str(exc).removeprefix('text: ')}") from None

    async def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        if self.tokenizer is None:
            raise invalid("messages", "messages: this model has no tokenizer, so it cannot render a chat")
        try:
            # The template writes the special tokens (BOS) itself; the messages' text stays text.
            return await asyncio.to_thread(self.tokenizer.encode_chat, messages, True, tools)
        except ValueError as exc:
            raise invalid("messages", f"messages: {str(exc).removeprefix('messages: ')}") from None

    def echo(self, prompt: str | list[int], prompt_ids: list[int]) -> PromptEcho:
        """The prompt as ``echo`` returns it (its text as given, or its ids decoded)."""
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids) if self.tokenizer else ""
        return PromptEcho(text, [self.token_bytes.bytes_of(t) for t in prompt_ids])

    def default_max_tokens(self, prompt_ids: list[int]) -> int:
        """Without max_tokens a chat may use the rest of the context."""
        return max(1, self.info.max_seq_len - len(prompt_ids))

    def check(self, prompt_ids: list[int], params: SamplingParams, prompt_param: str = "prompt",
              max_tokens_param: str = "max_tokens") -> None:
        """Raises a 400 naming the request's parameter when the engine could not serve this."""
        try:
            params.validate(self.info.vocab_size)
        except ValueError as exc:
            raise from_value_error(exc, {"max_new_tokens": max_tokens_param}) from None
        for name in ("seed", "top_k"):
            value = getattr(params, name)
            # The processes exchange msgpack, whose integers are 64-bit.
            if value is not None and not INT64_MIN <= value <= INT64_MAX:
                raise invalid(name, f"{name} must fit in a signed 64-bit integer (got {value})")
        limit = self.info.max_seq_len
        if not prompt_ids:
            raise invalid(prompt_param, f"{prompt_param}: must contain at least one token")
        if len(prompt_ids) >= limit:
            raise APIError(400, f"{prompt_param}: {len(prompt_ids)} tokens leave no room in the context of "
                                f"{limit} tokens", param=prompt_param, code=CONTEXT_LENGTH_EXCEEDED)
        bad = next((t for t in prompt_ids if not 0 <= t < self.info.vocab_size), None)
        if bad is not None:
            raise invalid(prompt_param, f"{prompt_param}: token id {bad} is outside the vocabulary "
                                        f"(0..{self.info.vocab_size - 1})")
        if len(prompt_ids) + params.max_new_tokens > limit:
            raise APIError(400, f"{max_tokens_param}: the prompt ({len(prompt_ids)} tokens) plus {max_tokens_param} "
                                f"({params.max_new_tokens}) exceeds the context length {limit}",
                           param=max_tokens_param, code=CONTEXT_LENGTH_EXCEEDED)
        if params.stop and self.tokenizer is None:
            raise invalid("stop", "stop: stop strings need a tokenizer, and this model has none")
        if params.stop_regex and self.tokenizer is None:
            raise invalid("stop_regex", "stop_regex: stop regexes need a tokenizer, and this model has none")

    # ---- requests ------------------------------------------------------------------------------

    def submit(self, prompts: list[list[int]], params: SamplingParams,
               max_tokens_param: str = "max_tokens", lora: str | None = None,
               bootstrap: dict[str, Any] | None = None) -> RequestStream:
        """Sends each prompt to its replica; ``lora``: the adapter to run them under (None: the base);
        ``bootstrap``: a disaggregated request's room and prefill address (server/disaggregation.py),
        for a single prompt."""
        if bootstrap is not None and (len(prompts) > 1 or params.n > 1):
            raise invalid("bootstrap_room", "bootstrap_room: a disaggregated request has one prompt and n=1")
        if self.failure is not None:
            raise APIError(503, f"the engine is unavailable: {self.failure}")
        self._admit(len(prompts) * params.n)
        stream = RequestStream(self, len(prompts) * params.n, max_tokens_param)
        wire_params = asdict(params)
        options = ipc.AddOptions(lora=lora, bootstrap=bootstrap, origin=self.api_server).to_wire()
        now = time.monotonic()
        for index, prompt_ids in enumerate(prompts):
            rid = uuid.uuid4().hex
            replica = self._router.route(prompt_ids)
            self._live[rid] = _Live(stream, index, params.n, now, replica)
            stream.rids.append(rid)
            self._send(replica, [ipc.ADD, rid, prompt_ids, wire_params, options])
        return stream

    def _admit(self, samples: int) -> None:
        """Counts the submission's samples in flight, or refuses it when the queue is full."""
        limit = self.admission.max_queued_requests
        ceiling = None if limit is None else self.info.max_running + limit
        if not self._samples_in_flight.reserve(samples, ceiling):
            self.metrics.queue_rejections.inc()
            raise APIError(503, f"the request queue is full ({limit} requests may wait beyond the "
                                f"{self.info.max_running} running; --max-queued-requests); retry after "
                                f"{QUEUE_RETRY_AFTER_S} s", code=QUEUE_FULL, retry_after=QUEUE_RETRY_AFTER_S)

    def release(self, stream: RequestStream) -> None:
        """Forgets a stream's requests, aborting those still running."""
        for rid in stream.rids:
            live = self._forget(rid)
            if live is not None and self.failure is None:
                self._send(live.replica, [ipc.ABORT, rid])

    @property
    def in_flight(self) -> int:
        return len(self._live)

    def fail_all(self, status: int, message: str) -> None:
        for rid in list(self._live):
            self._forget(rid).stream.put(APIError(status, message))

    def _forget(self, rid: str) -> _Live | None:
        """Ends a request's bookkeeping here (its replica's load with it); None if it had ended."""
        live = self._live.pop(rid, None)
        if live is not None:
            self._samples_in_flight.release(live.samples)
            self._router.finished(live.replica)
        return live

    def broadcast(self, message: list[Any]) -> None:
        """Sends ``message`` to every replica's scheduler (LoRA loads and unloads)."""
        for replica in range(len(self._senders)):
            self._send(replica, message)

    def _send(self, replica: int, message: list[Any]) -> None:
        # A PUSH socket without a high-water mark queues and returns: safe on the event loop.
        self._senders[replica].send(ipc.pack(message))

    # ---- from the detokenizer ------------------------------------------------------------------

    def dispatch(self, message: list[Any]) -> None:
        kind = message[0]
        if kind == ipc.OUTPUTS:
            now = time.monotonic()
            for output in message[1]:
                self._output(now, *output)
        elif kind == ipc.STATS:
            self.metrics.replica_stats[message[2]] = message[1]
        elif kind == ipc.REJECT:
            live = self._forget(message[1])
            if live is not None:
                renames = {"max_new_tokens": live.stream.max_tokens_param}
                # A status: a refusal that is no bad input (a disaggregation peer gone).
                status = message[3]
                live.stream.put(from_value_error(ValueError(message[2]), renames) if status is None
                                else APIError(status, message[2]))
        elif kind == ipc.FATAL:
            self.failure = message[1]
            self.fail_all(500, message[1])
            self._on_fatal(message[1])

    def _output(self, now: float, rid: str, index: int, text: str, token_ids: list[int], logprobs: list[list[Any]],
                finish_reason: str | None, error: str | None, prompt_tokens: int, cached_tokens: int,
                spec_verify_ct: int, spec_verify_tokens: int, prompt_logprobs: list[float],
                matched_stop: int | str | None) -> None:
        live = self._live.get(rid)
        if live is None:
            return  # aborted here already; the scheduler's last words for it
        if error is not None:
            # The core fails a single request for what it asked (a constraint that does not
            # compile: a client error), or for its own fault while serving it alone (a 500).
            self._forget(rid)
            internal = error.startswith(INTERNAL_ERROR)
            # Tool calls are the only structural tags the server builds: a schema xgrammar refuses.
            param = "tools" if "structural_tag" in error else "response_format"
            live.stream.put(APIError(500, error) if internal else invalid(param, error))
            return
        if token_ids:
            self._time_tokens(live, index, now, len(token_ids))
        live.stream.note_prompt(live.prompt_index, index, prompt_tokens, cached_tokens)
        entries = [TokenLogprob(t, b, lp, tuple((a, ab, alp) for a, ab, alp in top)) for t, b, lp, top in logprobs]
        live.stream.put(SampleOutput(live.prompt_index, index, text, token_ids, entries, finish_reason,
                                     prompt_logprobs, matched_stop))
        if finish_reason is not None:
            # The counts are the sample's totals so far: its last event has them all.
            live.stream.usage.spec_verify_ct += spec_verify_ct
            live.stream.usage.spec_verify_tokens += spec_verify_tokens
            live.open_samples -= 1
            if live.open_samples == 0:
                self._forget(rid)
                self.metrics.prompt_tokens.inc(prompt_tokens)
                self.metrics.e2e.observe(now - live.arrival)

    def _time_tokens(self, live: _Live, index: int, now: float, count: int) -> None:
        self.metrics.generation_tokens.inc(count)
        last = live.last_token_at.get(index)
        if last is None:
            if not live.last_token_at:
                self.metrics.ttft.observe(now - live.arrival)
        else:
            self.metrics.itl.observe(now - last)
        live.last_token_at[index] = now

    async def receive_loop(self, socket: zmq.asyncio.Socket, other: Callable[[list[Any]], bool] | None = None) -> None:
        """Dispatches what arrives on ``socket``; ``other`` takes a message first (the API servers' questions
        to one another) and says whether it was one of its own."""
        while True:
            message = ipc.unpack(await socket.recv())
            if other is None or not other(message):
                self.dispatch(message)
