"""The engine core: scheduler + worker (the model on one rank or several) + sampling, one ``step()``
at a time, no threads (but one at start-up, which loads the tokenizer beside the weights, and the one
that fills an overlapped step's grammar masks while the host applies the step before).

``add_request`` validates and queues a request (n samples become n scheduler requests; the first
leads, the others share its cached prompt); ``step`` schedules a batch, runs it, samples, applies
the stop rules and returns a ``SampleEvent`` per sample that advanced or ended. The in-process
``Engine`` drives it from a thread; the server's scheduler process drives it from its loop.

Overlap (``runtime/overlap``): a greedy decode step run as a graph is left in flight, and the next
``step`` launches the step after it before reading the in-flight tokens, so the host's work hides
behind the device's.

Speculative decoding (``speculative_algorithm``): a step with decoding requests goes to the
``Speculator`` (runtime/spec), which drafts, verifies the drafts in the same step and applies the
accepted tokens; steps are then never overlapped.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from itertools import repeat
from typing import Any, Hashable, Iterable

import torch

from .artifact import load_artifact
from .constraints import Constraints, constraint_of
from .engine_options import DEFAULT_CPU_KV_TOKENS, EngineOptions, graph_settings
from .kernel_cache import hash_triton_early, open_kernel_cache
from .kvcache.allocator import PageAllocator
from .device_support import uses_references
from .kvcache.pool import pages_for_mem_fraction, pages_for_tokens, pool_dtype
from .kvcache.radix import RadixCache
from .lora.registry import LoraRegistry
from .outputs import EXPERT_TOKENS, INTERNAL_ERROR, SampleEvent, TokenLogprob
from .overlap import DecodeOverlap
from .sampling import SamplerOutput, SamplingBatch, SamplingParams, SamplingRow, child_seed, masked_argmax, new_seed
from .scheduler.batch import StepLists, build_step_lists
from .scheduler.request import PENDING, Request, RequestState
from .scheduler.scheduler import Scheduler, SchedulerConfig
from .spec.config import SpecConfig
from .spec.speculator import Speculator
from .startup import StartupTimer
from .text.stop_rules import STOP_RULES, StopRules, finish_reason_after_grammar, matched_stop, sampled_on_device
from .text.tokenizer import Tokenizer
from .worker.executor import graph_blockers
from .worker.nodes import check_layout
from .worker.ranks import start_worker
from .worker.worker import LocalWorker, RankConfig


class EngineCore:
    def __init__(self, artifact_path: str, options: EngineOptions | None = None,
                 startup: StartupTimer | None = None) -> None:
        """``startup`` times the loading phases (``kiln.runtime.startup``); ``self.startup`` has them."""
        self.options = options or EngineOptions()
        self.startup = startup or StartupTimer("engine")
        with self.startup.phase("artifact_read"):
            self.artifact = load_artifact(artifact_path)
        rt = self.artifact.runtime
        bounds = rt["symbol_bounds"]
        device = self.options.resolved_device()
        if device.type == "cuda":
            hash_triton_early()
        spec = SpecConfig.from_options(self.options, bounds)  # refused before anything starts
        self.max_seq_len: int = rt["max_seq_len"]
        self.vocab_size: int = rt["vocab_size"]
        self.page_size: int = rt["page_size"]
        # The tokenizer loads on a thread while the weights go to the device (which releases the GIL).
        loading = ThreadPoolExecutor(1, thread_name_prefix="kiln-tokenizer")
        tokenizer = loading.submit(self._load_tokenizer)
        loading.shutdown(wait=False)
        # Refuses here, naming what needs FP8, when the GPU cannot run it and no fallback was asked for.
        references = uses_references(self.artifact, device, self.options.reference_fallback)
        buckets, prefill_graphs = graph_settings(self.options, device, graph_blockers(self.artifact, references))
        num_pages = self._num_pages(device, rt)
        # Even with one request the pool must hold a full context, or that request could never run.
        if (num_pages - 1) * self.page_size < self.max_seq_len:
            raise ValueError(f"the KV pool holds {(num_pages - 1) * self.page_size} tokens, less than "
                             f"the context length {self.max_seq_len}; raise kv_cache_tokens or mem_fraction")
        # What the core drives (every rank), and rank 0's model runner, for tools that look inside it.
        ranks = rt["ranks"]  # a sharded artifact's own ranks: pp x max(tp, ep)
        world_size = self._world_size(rt)
        check_layout(world_size, self.options.nnodes, 0, self.options.dist_init_addr)
        # On a GPU, Triton reads the artifact's kernel binaries for this machine (kernel_cache.py).
        self.kernel_cache = open_kernel_cache(self.artifact.path, device.index or 0) \
            if device.type == "cuda" and not references else None
        self.worker = start_worker(self.artifact, RankConfig(
            str(self.artifact.path), str(device), num_pages, buckets, prefill_graphs, world_size,
            ranks > 1, self.options.reference_fallback, spec.tokens_per_verify if spec is not None else 1,
            pp=rt["pp"], nnodes=self.options.nnodes, dist_init_addr=self.options.dist_init_addr), self.startup)
        self.tokenizer = tokenizer.result()
        if self.kernel_cache is not None:
            with self.startup.phase("kernel_save"):  # what the warm-up compiled, for the next start
                self.kernel_cache.save()
        self.runner = self.worker.runner
        self.allocator = PageAllocator(self.worker.num_pages)
        self.cache = RadixCache(self.allocator, self.page_size)
        self.lora = self._lora_registry()
        self.scheduler = Scheduler(SchedulerConfig(
            max_batch_tokens=min(self.options.max_batch_tokens or bounds["T"], bounds["T"]),
            # Every running request may decode in the same step: one token and one logits row each.
            max_running=min(self.options.max_running or bounds["B"], bounds["B"], bounds["N"], bounds["T"]),
            page_size=self.page_size, max_logit_rows=bounds["N"], policy=self.options.schedule_policy,
            enable_prefix_cache=self.options.enable_prefix_cache), self.allocator, self.cache, self.lora)
        self.eos_ids: set[int] = set(self.tokenizer.eos_token_ids) if self.tokenizer else set()
        self.constraints = Constraints(self.tokenizer, self.vocab_size, self.eos_ids,
                                       grammar_threads=self.options.grammar_threads)
        self._requests: dict[str, list[Request]] = {}
        # Speculative decoding (runtime/spec): decode steps verify drafts; never overlapped (see SpecConfig).
        self.speculator = Speculator(spec, self) if spec is not None else None
        overlap = self.options.overlap_schedule
        overlap = bool(buckets) if overlap is None else overlap and bool(buckets)
        # Not with several ranks (WorkerGroup: tokens come back through rank 0's pipe), nor speculation.
        overlap = overlap and self.worker.tokens_from_device and self.speculator is None
        self.overlap = DecodeOverlap(self, max(buckets, default=1), device) if overlap else None

    def _load_tokenizer(self) -> Tokenizer | None:
        with self.startup.phase("tokenizer"):
            return Tokenizer.from_dir(self.artifact.tokenizer_dir) if self.artifact.tokenizer_dir else None

    def _lora_registry(self) -> LoraRegistry | None:
        """The adapter registry of a LoRA artifact (its slots are rank 0's runner's), else None."""
        slots = self.runner.lora_slots
        if slots is None:
            return None
        if not isinstance(self.worker, LocalWorker):
            raise ValueError("LoRA adapters run on one rank (world_size=1) for now")
        return LoraRegistry(slots.layout, slots.dtype, slots.write)

    def load_lora(self, name: str, path: str) -> None:
        """Reads and checks the PEFT adapter at ``path`` and serves it as ``name`` (ValueError naming
        what is wrong: an adapter kiln cannot serve, a name in use, an artifact without LoRA slots)."""
        self._registry().add(name, path)

    def unload_lora(self, name: str) -> None:
        """Forgets ``name`` (UnknownAdapter if none); its requests already queued or running finish."""
        self._registry().remove(name)

    def lookup_lora(self, name: str):
        """The loaded adapter ``name``'s registry entry (UnknownAdapter if none)."""
        return self._registry().lookup(name)

    def lora_names(self) -> list[str]:
        return self.lora.names if self.lora is not None else []

    def _registry(self) -> LoraRegistry:
        if self.lora is None:
            raise ValueError("this artifact has no LoRA slots; compile it with max_loras > 0 (kiln compile "
                             "--max-loras N, or Engine(..., max_loras=N))")
        return self.lora

    def _world_size(self, rt: dict[str, Any]) -> int:
        """The artifact's own ranks (pp x max(tp, ep)), or the options' replicated ones for a one-rank artifact."""
        ranks = rt["ranks"]
        if ranks == 1:
            return self.options.world_size
        if self.options.world_size not in (1, ranks):
            kind = ("tensor-parallel" if rt["ep"] == 1 else "expert-parallel") if rt["pp"] == 1 else f"pipelined ({rt['pp']} stages of tp={rt['tp']})"
            raise ValueError(f"world_size: the artifact is {kind} over {ranks} ranks and runs on exactly "
                             f"{ranks}, not {self.options.world_size}")
        return ranks

    def _num_pages(self, device: torch.device, rt: dict[str, Any]) -> int:
        if self.options.kv_cache_tokens is not None:
            return pages_for_tokens(self.options.kv_cache_tokens, rt["page_size"])
        if device.type == "cuda":
            # Sized before the weights load: rank 0's share (every rank's on one GPU each) still to come.
            return pages_for_mem_fraction(self.options.mem_fraction, device, rt["num_layers"], rt["num_kv_heads"],
                                          rt["head_dim"], pool_dtype(rt), rt["page_size"], self.artifact.weight_bytes())
        return pages_for_tokens(max(DEFAULT_CPU_KV_TOKENS, rt["max_seq_len"]), rt["page_size"])

    # ---- requests --------------------------------------------------------------------------------

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                    namespace: Hashable = None, lora: str | None = None) -> None:
        """Queues a request, under the LoRA adapter named ``lora`` if given; raises ValueError (naming
        the parameter) when it cannot be served, UnknownAdapter when no adapter has that name."""
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        self.validate(prompt_ids, params)
        adapter = self.lookup_lora(lora) if lora is not None else None
        if adapter is not None:  # its KV is its adapter's: never shared with the base model or another
            namespace = (namespace, adapter.namespace)
        seed = params.seed if params.seed is not None else new_seed()
        samples: list[Request] = []
        for index in range(params.n):
            leader = samples[0] if samples else None
            samples.append(Request(rid=rid, prompt_ids=list(prompt_ids), params=params,
                                   seed=seed if index == 0 else child_seed(seed, index), index=index,
                                   namespace=namespace, leader=leader, lora=adapter))
            samples[-1].extras[STOP_RULES] = StopRules(params, prompt_ids, self.eos_ids, self.max_seq_len,
                                                       self.tokenizer)
        if constraint_of(params) is not None:
            self.constraints.start(samples)
        else:
            for request in samples:
                self.scheduler.add(request)
        self._requests[rid] = samples

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        params.validate(self.vocab_size)
        if not prompt_ids:
            raise ValueError("prompt: must contain at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if len(prompt_ids) + params.max_new_tokens > self.max_seq_len:
            raise ValueError(f"max_new_tokens: prompt ({len(prompt_ids)} tokens) plus max_new_tokens "
                             f"({params.max_new_tokens}) exceeds the context length {self.max_seq_len}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, and this artifact has none")

    def abort(self, rid: str, error: str | None = None) -> list[SampleEvent]:
        """Ends every sample of ``rid`` at once, freeing its KV; ``error`` says why, when it failed."""
        events = []
        self.constraints.cancel(rid)
        for request in self._requests.pop(rid, []):
            if not request.done:
                self.scheduler.abort(request)
                events.append(self._event(request, (), (), "abort", error))
        return events

    def close(self) -> None:
        """Stops the worker processes, if any (see ``worker.ranks``), and saves the Triton kernels
        compiled since start-up into the artifact (lazily captured prefill graphs' kernels); the core
        is unusable after."""
        self.worker.close()
        if self.kernel_cache is not None:
            self.kernel_cache.save()

    def warm_up_idle(self) -> bool:
        """Captures the next step graph not captured yet, with a step that stores nothing: a decode
        bucket first (every decoding step needs one), then a verify bucket, then a prefill bucket
        (each set's ``uncaptured``, smallest first); False when none is left (or the step did not
        capture its bucket, which would otherwise be warmed again and again). For a server with
        nothing else to do: a capture costs a warm-up run and the capture itself, which the first step
        of each bucket would otherwise wait for (on an H100, a fresh SmolLM2 server's first 512
        requests ran at 89% of the rate of the next 512 before prefill graphs were warmed)."""
        if self.has_work():
            return False
        for name in ("decode_graphs", "verify_graphs", "prefill_graphs"):
            graphs = getattr(self.runner, name, None)
            pending = graphs.uncaptured() if graphs is not None else []
            if pending:
                self.worker.forward(graphs.warm_up_lists(pending[0]))
                return pending[0] not in graphs.uncaptured()
        return False

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.constraints.has_pending() or \
            (self.overlap is not None and self.overlap.busy)

    def stats(self) -> dict[str, float]:
        """Gauges and counters for metrics: queue lengths, KV pool use, prefix-cache hits."""
        total = self.allocator.total
        # Pages the radix cache holds but no request uses can be evicted at any time, so they count
        # as available; "held" pages are the ones running requests pin (zero when idle).
        available = self.allocator.free_count + self.cache.evictable_pages
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_pages_total": total,
            "kv_pages_used": total - self.allocator.free_count,
            "kv_pages_free": self.allocator.free_count,
            "kv_pages_cached": self.cache.cached_pages,
            "kv_pages_available": available,
            "kv_pages_held": total - available,
            "radix_locked_nodes": self.cache.locked_nodes(),
            "kv_usage": (total - self.allocator.free_count) / total if total else 0.0,
            "cache_hit_tokens": self.cache.hit_tokens,
            "cache_queried_tokens": self.cache.queried_tokens,
            "cache_hit_rate": self.cache.hit_tokens / self.cache.queried_tokens if self.cache.queried_tokens else 0.0,
            "retractions": self.scheduler.num_retractions,
            "overlapped_steps": self.overlapped_steps,
            **(self.speculator.stats() if self.speculator is not None else {}),
            **self.expert_load_stats(),
        }

    @property
    def overlapped_steps(self) -> int:
        """Decode steps launched while the step before them was in flight (0 when not overlapping)."""
        return self.overlap.steps if self.overlap is not None else 0

    def expert_load_stats(self) -> dict[str, int]:
        """Tokens sent to each expert of each sparse layer since start, as ``expert_tokens:{layer}:{expert}``
        (a MoE model's; empty otherwise). Rank 0's counters: the router is replicated, so it sees every
        token. Reading them waits for the device's queued work."""
        return {f"{EXPERT_TOKENS}{layer}:{expert}": count for layer, counts in self.runner.expert_load.read().items()
                for expert, count in enumerate(counts)}

    # ---- one step -----------------------------------------------------------------------------------

    def step(self) -> list[SampleEvent]:
        events = self._release_constrained()
        if self.overlap is not None and self.overlap.busy:
            return events + self.overlap.continue_step()
        batch = self.scheduler.schedule()
        if batch is None:
            if self.constraints.has_pending():
                time.sleep(0.001)  # only grammars compiling: wait for them without spinning
            return events
        if self.speculator is not None and batch.decodes:
            return events + self.speculator.step(batch)
        lists = build_step_lists(batch, self.page_size)
        result = self.worker.forward(lists)
        logits, greedy = result.logits, result.greedy
        self.scheduler.complete_step(batch)
        if self.speculator is not None:
            self.speculator.absorb_prefill(batch, lists, result.outputs)
        if lists.prompt_rows:
            _score_prompt_rows(lists, logits)
            logits = logits[:len(lists.requests)]
        if not lists.requests:
            return events
        requests = lists.requests
        if greedy is not None and not lists.prompt_rows and all(sampled_on_device(r) for r in requests):
            by_argmax = _graph_argmax_serves(requests)
            tokens = greedy if by_argmax else self.device_tokens(requests, logits, greedy,
                                                                 self.constraints.mask(requests, logits))
            if self.overlap is not None:
                # Read these tokens next step, after the step that follows is already launched.
                self.overlap.hold(lists, tokens, by_argmax)
                return events
            out = SamplerOutput(tokens, None, None, None)
        else:
            rows = [SamplingRow(r.params, r.seed, len(r.output_ids), r.prompt_ids, r.output_ids) for r in requests]
            mask = self.constraints.mask(requests, logits)
            out = self.worker.sample(logits, SamplingBatch.pack(rows, self.vocab_size, logits.device), mask)
        return events + self.apply(lists, out)

    def device_tokens(self, requests: list[Request], logits: torch.Tensor, greedy: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor:
        """The step's tokens, left on the device, for requests that pass ``sampled_on_device`` but
        not ``_graph_argmax_serves``: the argmax under ``mask`` (the step's grammar bitmask, filled on
        the CPU while the step runs; None: no row constrained) when all are greedy, else the sampler's draw."""
        if all(r.params.argmax_of_logits for r in requests):
            return greedy if mask is None else masked_argmax(logits, mask, self.runner.sampler_kernels)
        rows = [SamplingRow(r.params, r.seed, len(r.output_ids)) for r in requests]
        return self.worker.sample(logits, SamplingBatch.pack(rows, self.vocab_size, logits.device), mask).token_ids

    def advance_grammars(self, lists: StepLists, tokens: list[int]) -> Iterable[str | None]:
        """Moves every constrained row's grammar over its token (``tokens[i]`` is row i's), in one
        pass; per row the finish reason that gives (``Constraints.advance_all``)."""
        return Constraints.advance_all(lists.requests, tokens) or repeat(None)

    def apply(self, lists: StepLists, out: SamplerOutput,
              grammar_reasons: Iterable[str | None] | None = None) -> list[SampleEvent]:
        """Appends each sampled token (filling the PENDING slot an overlapped step left for it),
        applies the stop rules and makes the events; the grammars move over the tokens first, unless
        the caller did (``grammar_reasons``: ``advance_grammars``' verdicts). (This loop runs for every
        running sample every step, so it reads each request's fields once and skips the logprobs unless
        some were taken.)"""
        events: list[SampleEvent] = []
        tokens = out.token_ids.tolist()
        logprobs = _token_logprobs(lists.requests, tokens, out) if out.logprobs is not None else repeat(())
        if grammar_reasons is None:
            grammar_reasons = self.advance_grammars(lists, tokens)
        fail_id = self.options.debug_fail_token_id
        for request, token, token_logprobs, grammar_reason in zip(lists.requests, tokens, logprobs, grammar_reasons):
            if request.done:
                continue  # aborted meanwhile, or a sibling sample's failure ended the whole request
            output = request.output_ids
            if output and output[-1] == PENDING:
                output[-1] = token
            else:
                output.append(token)
            try:
                if fail_id is not None and fail_id in request.prompt_ids:
                    raise RuntimeError(f"debug_fail_token_id {fail_id}: injected failure")
                reason = finish_reason_after_grammar(request, token, grammar_reason)
            except Exception as exc:  # one request's fault (its stop rules, its text) fails it alone
                events.extend(self.abort(request.rid, f"{INTERNAL_ERROR}{type(exc).__name__}: {exc}"))
                continue
            if reason is not None:
                if reason == "error":
                    events.extend(self.abort(request.rid, f"the grammar rejected token {token}"))
                    continue
                self.scheduler.finish(request, reason)
                self.forget_if_done(request.rid)
            # (SampleEvent directly, not through _event: a call per sample costs ~10% of this loop.)
            scored = tuple(request.prompt_logprobs) if request.prompt_logprobs and len(output) == 1 else ()
            matched = matched_stop(request) if reason == "stop" else None
            events.append(SampleEvent(request.rid, request.index, (token,), token_logprobs, reason, None,
                                      len(request.prompt_ids), request.cached_tokens, prompt_logprobs=scored,
                                      matched_stop=matched))
        return events

    def _release_constrained(self) -> list[SampleEvent]:
        """Queues requests whose grammar compiled; ends those whose constraint failed (400)."""
        if not self.constraints.has_pending():
            return []
        ready, failed = self.constraints.poll()
        for request in ready:
            self.scheduler.add(request)
        events = []
        for samples, error in failed:
            self._requests.pop(samples[0].rid, None)
            for sample in samples:
                sample.state = RequestState.ABORTED
                events.append(self._event(sample, (), (), "abort", error))
        return events

    def forget_if_done(self, rid: str) -> None:
        if all(r.done for r in self._requests.get(rid, [])):
            self._requests.pop(rid, None)

    def _event(self, request: Request, tokens: tuple[int, ...], logprobs: tuple[TokenLogprob, ...],
               reason: str | None, error: str | None = None) -> SampleEvent:
        return SampleEvent(request.rid, request.index, tokens, logprobs, reason, error, len(request.prompt_ids),
                           request.cached_tokens)


def _token_logprobs(requests: list[Request], tokens: list[int], out: SamplerOutput
                    ) -> list[tuple[TokenLogprob, ...]]:
    """Each row's chosen-token logprob and top alternatives, for the requests that asked for them."""
    chosen = out.logprobs.tolist()
    top_ids = out.top_ids.tolist() if out.top_ids is not None else None
    top_values = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    rows: list[tuple[TokenLogprob, ...]] = []
    for row, (request, token) in enumerate(zip(requests, tokens)):
        k = request.params.top_logprobs
        if not (request.params.logprobs or k):
            rows.append(())
            continue
        top = tuple(zip(top_ids[row][:k], top_values[row][:k])) if k else ()
        rows.append((TokenLogprob(token, chosen[row], top),))
    return rows


def _score_prompt_rows(lists: StepLists, logits: torch.Tensor) -> None:
    """Records, for each prompt-scoring row, the logprob of the prompt token that follows it."""
    first = len(lists.requests)
    rows = logits[first:first + len(lists.prompt_rows)].float().log_softmax(dim=-1)
    targets = torch.tensor([r.prompt_ids[p + 1] for r, p in lists.prompt_rows], device=rows.device)
    values = rows.gather(1, targets[:, None])[:, 0].tolist()
    for (request, position), value in zip(lists.prompt_rows, values):
        del request.prompt_logprobs[position:]  # positions computed again after a retraction
        request.prompt_logprobs.append(value)


def _graph_argmax_serves(requests: list[Request]) -> bool:
    """The decode graph's in-graph argmax is every row's token: nothing to mask, add or sample."""
    return all(r.params.argmax_of_logits for r in requests) and not Constraints.any_constrained(requests)
