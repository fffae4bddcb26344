"""``kiln serve --stream-interval N`` (SGLang's option): a running sample's tokens leave the scheduler
process every N tokens instead of every step.

Every step's events cost the scheduler's thread their packing and sending, and the detokenizer and
the API servers their handling, one SSE frame a token a stream: at high concurrency the HTTP side's
CPU, not the GPU, can bound served throughput. Holding a sample's events until it has N new tokens
cuts all of that by N, at the price of text arriving in chunks of N tokens. A sample's first token
goes out at once (time to first token is unchanged), and its last with the tokens held before it
(so nothing is ever left behind: finishing, by any reason, an abort included, always sends).
"""

from __future__ import annotations

from kiln.runtime.outputs import SampleEvent


class StreamInterval:
    def __init__(self, interval: int) -> None:
        if interval < 1:
            raise ValueError(f"--stream-interval: must be at least 1, got {interval}")
        self.interval = interval
        self._held: dict[tuple[str, int], SampleEvent] = {}  # tokens not sent yet, as one event
        self._started: set[tuple[str, int]] = set()  # samples whose first token has gone out

    def release(self, events: list[SampleEvent]) -> list[SampleEvent]:
        """What of ``events`` (and of the events held before them) goes out now, in order."""
        if self.interval == 1:
            return events
        out = []
        for event in events:
            key = (event.rid, event.index)
            held = self._held.pop(key, None)
            if held is not None:
                event = _joined(held, event)
            if event.finish_reason is not None:
                self._started.discard(key)
                out.append(event)
            elif key not in self._started:
                self._started.add(key)
                out.append(event)
            elif len(event.token_ids) >= self.interval:
                out.append(event)
            else:
                self._held[key] = event
        return out


def _joined(first: SampleEvent, then: SampleEvent) -> SampleEvent:
    """Two consecutive events of one sample as one: the tokens and logprobs of both, the later one's
    counts and finish (the prompt's logprobs come with the first)."""
    return then._replace(token_ids=first.token_ids + then.token_ids, logprobs=first.logprobs + then.logprobs,
                         prompt_logprobs=first.prompt_logprobs or then.prompt_logprobs)
