"""``kiln.Engine``: the in-process API. A background thread drives the engine core; callers submit
requests from any thread or event loop and get outputs, or stream text deltas.

    with Engine("smollm2-135m-instruct") as engine:
        print(engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                          SamplingParams(temperature=0, max_new_tokens=20)).text)

Bad input (invalid sampling parameters, a prompt beyond the context) raises ``ValueError`` at once
in the caller; the engine keeps serving everything else.

``tp="auto"`` (and ``pp="auto"``) asks the planner for the layout of a model compiled on first use
(``kiln.planner.auto``; ``gpus`` and ``gpu_memory_gb`` are its hints where there are no GPUs to count).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, Sequence, Union

from kiln.artifact_cache import ensure_model_artifacts, is_artifact
from kiln.compiler.options import CompileOptions
from kiln.loop_post import LoopPosts
from kiln.planner.auto import LayoutHints, resolve_layout
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.outputs import RequestOutput, StreamDelta
from kiln.runtime.request_handle import RequestHandle
from kiln.runtime.sampling import SamplingParams

Prompt = Union[str, Sequence[int]]
Messages = Sequence[dict[str, Any]]
ParamsLike = Union[SamplingParams, dict[str, Any], None]


class Engine:
    def __init__(self, model: str | Path, *, dtype: str = "bf16", backend: str | None = None,
                 max_batch_tokens: int = 2048, max_batch_size: int = 256, max_seq_len: int | None = None,
                 page_size: int = 16, device: str | None = None, kv_cache_tokens: int | None = None,
                 mem_fraction: float = 0.85, schedule_policy: str = "lpm", enable_prefix_cache: bool = True,
                 world_size: int = 1, quantization: str | None = None, quantize_lm_head: bool = False,
                 kv_cache_dtype: str = "auto",
                 tp: int | str = 1, pp: int | str | None = None, ep: int = 1, gpus: int | None = None,
                 gpu_memory_gb: float | None = None, reference_fallback: bool = False, speculative_algorithm: str | None = None,
                 speculative_num_draft_tokens: int | None = None, speculative_num_steps: int | None = None,
                 speculative_eagle_topk: int | None = None, speculative_draft_model_path: str | None = None,
                 speculative_ngram_min_match_window_size: int = 1,
                 speculative_ngram_max_match_window_size: int = 12, lora_modules: dict[str, str] | None = None,
                 max_loras: int | None = None, max_lora_rank: int = 16) -> None:
        """``lora_modules`` ({name: PEFT directory}) are loaded at start; ``max_loras`` adapter slots
        (default: 1 with lora_modules, else none) of rank up to ``max_lora_rank`` are compiled in."""
        import torch

        # An artifact runs on the ranks it was compiled for; a model is compiled for tp x pp of them.
        layout = None if is_artifact(model) else resolve_layout(
            model, tp, pp, LayoutHints(gpus, gpu_memory_gb, dtype, quantization, max_seq_len))
        self.layout_reason = layout.reason if layout is not None else None  # the planner's, for tp="auto"
        on_gpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        compile_options = CompileOptions(dtype=dtype, backend=backend or ("triton" if on_gpu else "torch"),
                                         max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size,
                                         max_seq_len=max_seq_len, page_size=page_size, quantization=quantization,
                                         quantize_lm_head=quantize_lm_head,
                                         kv_cache_dtype=kv_cache_dtype, ep=ep,
                                         tp=layout.tp if layout else 1, pp=layout.pp if layout else 1,
                                         max_loras=(1 if lora_modules else 0) if max_loras is None else max_loras,
                                         max_lora_rank=max_lora_rank)
        # With an EAGLE head, the target returns the features the head reads and the head is compiled too.
        self.artifact_path, speculative_draft_model_path = ensure_model_artifacts(model, compile_options, dict(
            speculative_algorithm=speculative_algorithm, speculative_num_draft_tokens=speculative_num_draft_tokens,
            speculative_num_steps=speculative_num_steps, speculative_eagle_topk=speculative_eagle_topk,
            speculative_draft_model_path=speculative_draft_model_path))
        self.core = EngineCore(str(self.artifact_path), EngineOptions(
            device=device, kv_cache_tokens=kv_cache_tokens, mem_fraction=mem_fraction,
            schedule_policy=schedule_policy, enable_prefix_cache=enable_prefix_cache, world_size=world_size,
            reference_fallback=reference_fallback,
            speculative_algorithm=speculative_algorithm, speculative_num_draft_tokens=speculative_num_draft_tokens,
            speculative_num_steps=speculative_num_steps, speculative_eagle_topk=speculative_eagle_topk,
            speculative_draft_model_path=speculative_draft_model_path,
            speculative_ngram_min_match_window_size=speculative_ngram_min_match_window_size,
            speculative_ngram_max_match_window_size=speculative_ngram_max_match_window_size))
        # Prompts are user text: its encoder is made now (the scheduler process's core never needs it).
        self.tokenizer = self.core.tokenizer.prepare_for_requests() if self.core.tokenizer else None
        for name, path in (lora_modules or {}).items():
            self.core.load_lora(name, str(path))
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._handles: dict[str, RequestHandle] = {}
        self._posts = LoopPosts()  # async callers' outputs, one wake-up of their loop a step
        self._closed = False
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
        self._thread.start()

    # ---- public API ----------------------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: ParamsLike | Sequence[ParamsLike] = None,
                 lora: str | None = None) -> RequestOutput | list[RequestOutput]:
        """Text or token-id prompts (one, or a list) -> outputs, all submitted at once; ``lora``: the
        name of a loaded adapter to run them under (None: the base model)."""
        single = _is_single_prompt(prompts)
        batch = [prompts] if single else list(prompts)
        params = _params_for(batch, sampling_params)
        handles = [self._submit(self._encode(p), sp, lora=lora) for p, sp in zip(batch, params)]
        outputs = [h.wait() for h in handles]
        return outputs[0] if single else outputs

    def chat(self, messages: Messages | Sequence[Messages], sampling_params: ParamsLike | Sequence[ParamsLike] = None,
             lora: str | None = None) -> RequestOutput | list[RequestOutput]:
        """Conversations rendered with the model's chat template -> outputs."""
        single = not messages or isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        prompts = [self.chat_prompt_ids(c) for c in conversations]
        return self.generate(prompts[0] if single else prompts, sampling_params, lora)

    def stream(self, prompt: Prompt, sampling_params: ParamsLike = None, lora: str | None = None
               ) -> Iterator[StreamDelta]:
        """Text deltas as they are generated (blocking iterator)."""
        deltas: queue.SimpleQueue[StreamDelta | None] = queue.SimpleQueue()
        handle = self._submit(self._encode(prompt), _as_params(sampling_params), deltas.put, lora=lora)
        try:
            while (delta := deltas.get()) is not None:
                yield delta
            if handle.error is not None:
                raise handle.error
        finally:
            if not handle.finished:
                self.abort(handle.rid)

    async def async_generate(self, prompt: Prompt, sampling_params: ParamsLike = None, lora: str | None = None
                             ) -> RequestOutput:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        post = self._posts.for_loop(loop)
        handle = self._submit(self._encode(prompt), _as_params(sampling_params),
                              on_finish=lambda out: post.call(_resolve, done, out), lora=lora)
        try:
            return await done
        except asyncio.CancelledError:
            self.abort(handle.rid)
            raise

    async def async_stream(self, prompt: Prompt, sampling_params: ParamsLike = None, lora: str | None = None
                           ) -> AsyncIterator[StreamDelta]:
        deltas: asyncio.Queue[StreamDelta | None] = asyncio.Queue()
        post = self._posts.for_loop(asyncio.get_running_loop())
        handle = self._submit(self._encode(prompt), _as_params(sampling_params),
                              lambda d: post.call(deltas.put_nowait, d), lora=lora)
        try:
            while (delta := await deltas.get()) is not None:
                yield delta
            if handle.error is not None:
                raise handle.error
        finally:
            if not handle.finished:
                self.abort(handle.rid)

    def apply_chat_template(self, messages: Messages) -> str:
        if self.tokenizer is None:
            raise ValueError("messages: this artifact has no tokenizer, so it cannot render a chat")
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)

    def chat_prompt_ids(self, messages: Messages) -> list[int]:
        """The conversation's token ids: the template's markup is special tokens, the messages' text is
        text (see ``Tokenizer.encode_chat``); templates write BOS themselves."""
        if self.tokenizer is None:
            raise ValueError("messages: this artifact has no tokenizer, so it cannot render a chat")
        return self.tokenizer.encode_chat(list(messages), add_generation_prompt=True)

    def abort(self, rid: str) -> None:
        self._send("abort", rid)

    def load_lora(self, name: str, path: str | Path) -> None:
        """Serves the PEFT adapter at ``path`` as ``name`` (ValueError naming what is wrong)."""
        self._call(self.core.load_lora, name, str(path))

    def unload_lora(self, name: str) -> None:
        """Forgets adapter ``name``; its requests in flight finish with it (LookupError if unknown)."""
        self._call(self.core.unload_lora, name)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)
        if not self._thread.is_alive():  # else a step still runs; worker processes end with this one
            self.core.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- internals ----------------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this artifact has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the engine's thread, between steps (the registry and the device slots are
        the core's); its exception is raised here."""
        result: Future = Future()
        self._send("call", (result, fn, args))
        return result.result()

    def _submit(self, prompt_ids: list[int], params: SamplingParams,
                on_delta: Callable[[StreamDelta | None], None] | None = None,
                on_finish: Callable[[RequestOutput | BaseException], None] | None = None,
                lora: str | None = None) -> RequestHandle:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        if self._failure is not None:
            raise RuntimeError(f"the engine failed: {self._failure}")
        self.core.validate(prompt_ids, params)
        if lora is not None:
            self.core.lookup_lora(lora)  # an unknown adapter is refused here, in the caller
        handle = RequestHandle(uuid.uuid4().hex, prompt_ids, params, self.tokenizer, on_delta, on_finish)
        self._send("add", (handle, lora))
        return handle

    def _send(self, kind: str, payload: Any) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    def _loop(self) -> None:
        while not self._closed:
            self._drain_inbox()
            if not self.core.has_work():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                events = self.core.step()
            except BaseException as exc:  # a broken step must not hang every caller
                self._failure = exc
                for handle in self._handles.values():
                    handle.fail(exc)
                self._handles.clear()
                return
            for event in events:
                handle = self._handles.get(event.rid)
                if handle is not None and handle.on_event(event):
                    del self._handles[event.rid]
        for handle in self._handles.values():
            handle.fail(RuntimeError("the engine was shut down"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                handle, lora = payload
                try:
                    self.core.add_request(handle.rid, handle.prompt_ids, handle.params, lora=lora)
                    self._handles[handle.rid] = handle
                except (ValueError, LookupError) as exc:
                    handle.fail(exc)
            elif kind == "call":
                result, fn, args = payload
                try:
                    result.set_result(fn(*args))
                except Exception as exc:  # the caller's to handle; the engine goes on
                    result.set_exception(exc)
            elif kind == "abort":
                for event in self.core.abort(payload):
                    handle = self._handles.get(event.rid)
                    if handle is not None and handle.on_event(event):
                        del self._handles[event.rid]


def _resolve(future: asyncio.Future, result: RequestOutput | BaseException) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _is_single_prompt(prompts: Any) -> bool:
    return isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))


def _as_params(params: ParamsLike) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, dict):
        return SamplingParams(**params)
    return params


def _params_for(batch: list, params: ParamsLike | Sequence[ParamsLike]) -> list[SamplingParams]:
    if isinstance(params, (list, tuple)):
        if len(params) != len(batch):
            raise ValueError(f"sampling_params: {len(params)} given for {len(batch)} prompts")
        return [_as_params(p) for p in params]
    return [_as_params(params)] * len(batch)
