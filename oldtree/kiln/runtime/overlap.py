"""Overlapped decoding: the host prepares and applies one decode step while the device runs the next.

A greedy decode step run as a graph is left in flight (``hold``); the core's next step then comes
here (``continue_step``), which first launches the step after it (the same requests, each given a
PENDING output slot whose id the device fills from the in-flight step's tokens), then reads and
applies the in-flight tokens while the new step runs, so the host's work hides behind the device's.
A request that turns out to have finished drops its extra step's result. Anything else to schedule
(arrivals, prefill, sampling on the host, a short pool, a full context) breaks the chain: the
in-flight tokens are applied and the core schedules its next step normally.

A step whose tokens are not its graph's argmax (grammar masks, sampling on the device) needs the
in-flight tokens applied first: the masks follow the grammars over them, the sampler's step indices
follow the outputs. Its tokens are drawn at the start of the next ``continue_step`` (``UndrawnStep``),
and its grammar masks fill on a thread from the moment the in-flight tokens are accepted: beside the
rest of their application, the events' delivery and the next schedule, instead of before the draw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .outputs import SampleEvent
from .sampling import SamplerOutput
from .scheduler.batch import StepLists, build_step_lists
from .scheduler.request import DECODING, PENDING
from .scheduler.scheduler import ScheduleBatch
from .worker.token_readback import InflightStep, TokenReadback

if TYPE_CHECKING:
    from .engine_core import EngineCore
    from .grammar.step_mask import PendingMask


@dataclass(frozen=True)
class UndrawnStep:
    """A launched decode step whose tokens are drawn at the next step: its logits, its graph's
    greedy ids, and its grammar mask being filled (None: no row constrained)."""

    lists: StepLists
    logits: torch.Tensor
    greedy: torch.Tensor
    mask: PendingMask | None


class DecodeOverlap:
    """The in-flight decode step of an ``EngineCore`` that overlaps its steps, and the chain after it."""

    def __init__(self, core: EngineCore, max_rows: int, device: torch.device) -> None:
        self.core = core
        self.inflight: InflightStep | None = None
        self.undrawn: UndrawnStep | None = None
        self._readback = TokenReadback(max_rows, device)
        self.steps = 0  # follow-up steps launched while another was in flight

    @property
    def busy(self) -> bool:
        """A launched step is still to be read (or drawn first): the core's next step continues here."""
        return self.inflight is not None or self.undrawn is not None

    def hold(self, lists: StepLists, tokens: torch.Tensor, by_argmax: bool) -> None:
        """Leaves a launched decode step in flight: its tokens are read during the next step."""
        self.inflight = self._launch_readback(lists, tokens, by_argmax)

    def continue_step(self) -> list[SampleEvent]:
        """Draws the undrawn step's tokens, launches the step after the in-flight one when nothing
        else needs scheduling (its input ids taken on the device from the in-flight step's output),
        then reads and applies the in-flight step's tokens while the new one runs."""
        core = self.core
        if self.undrawn is not None:
            self.inflight = self._draw(self.undrawn)
            self.undrawn = None
        inflight, self.inflight = self.inflight, None
        follow_up = self._follow_up(inflight)
        undrawn = None
        if follow_up is not None:
            lists, batch, rows = follow_up
            tokens = inflight.tokens if rows is None else inflight.tokens.index_select(0, rows)
            result = core.worker.forward(lists, tokens_from=tokens)
            core.scheduler.complete_step(batch)
            if inflight.by_argmax:
                self.inflight = self._launch_readback(lists, result.greedy, by_argmax=True)
            else:
                undrawn = lists, result.logits, result.greedy
            self.steps += 1
        host_tokens = inflight.host_tokens()
        grammar_reasons = core.advance_grammars(inflight.lists, host_tokens.tolist())
        if undrawn is not None:
            lists, logits, greedy = undrawn
            self.undrawn = UndrawnStep(lists, logits, greedy, core.constraints.start_mask(lists.requests, logits))
        return core.apply(inflight.lists, SamplerOutput(host_tokens, None, None, None), grammar_reasons)

    def _draw(self, step: UndrawnStep) -> InflightStep:
        """Launches the undrawn step's draw (its mask's argmax, or the sampler) and its readback."""
        mask = step.mask.wait() if step.mask is not None else None
        return self._launch_readback(step.lists, self.core.device_tokens(step.lists.requests, step.logits,
                                                                         step.greedy, mask))

    def _launch_readback(self, lists: StepLists, tokens: torch.Tensor, by_argmax: bool = False) -> InflightStep:
        """Starts bringing a launched step's tokens to the host (nothing to copy when the step's
        graph wrote them there itself)."""
        return self._readback.launch(lists, tokens, self.core.worker.host_mirror(tokens), by_argmax)

    def _follow_up(self, inflight: InflightStep) -> tuple[StepLists, ScheduleBatch, torch.Tensor | None] | None:
        """The next decode step of exactly the in-flight requests (with the in-flight tokens' row
        order, when the scheduler's differs), or None when it must wait for the host: other work to
        schedule, a request ended (all were decoding), a page short, or the context full."""
        core = self.core
        requests = inflight.lists.requests
        # The requests' lengths: the in-flight step's contexts (its tokens are not appended yet).
        lengths = inflight.lists.kv_len
        scheduler = core.scheduler
        if scheduler.waiting or core.constraints.has_pending() or len(scheduler.running) != len(requests) \
                or any(r.state is not DECODING for r in requests) or max(lengths, default=0) + 1 > core.max_seq_len:
            return None
        new_pages = sum(1 for length in lengths if length % core.page_size == 0)
        if core.allocator.free_count < new_pages:
            return None  # growing would need eviction or retraction: leave that to a normal step
        for request in requests:
            request.output_ids.append(PENDING)
        batch = scheduler.schedule()
        lists = build_step_lists(batch, core.page_size)
        # The scheduler keeps running requests in order, so the rows usually line up already (the
        # lists compare by identity, Requests having no __eq__). (Not a blocking copy: that would
        # wait for the step in flight.)
        rows = None
        if lists.requests != requests:
            row_of = {id(r): i for i, r in enumerate(requests)}
            order = [row_of[id(r)] for r in lists.requests]
            rows = torch.tensor(order).to(inflight.tokens.device, non_blocking=True)
        return lists, batch, rows
