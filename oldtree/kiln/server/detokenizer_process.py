"""The detokenizer process: turns the scheduler's sample events into text deltas for the HTTP process.

    python -m kiln.server.detokenizer_process '{"ipc_dir": ..., "parent_pid": ..., "tokenizer_dir": ...}'

It loads the artifact's tokenizer at once (while the scheduler loads the model), then forwards the
scheduler's READY, so the HTTP process knows both are up (the first READY carries the detokenizer's
own start-up phases); with several data-parallel replicas it serves them all (request ids are
unique across them) and forwards each one's READY.
For every NEW request it keeps one ``SampleText`` per sample (the same incremental detokenizer and
stop-string cut the in-process Engine uses) and the API server it came from (``--api-server-count``:
each HTTP process has its own inbox); each EVENTS batch becomes one OUTPUTS batch per API server
with requests in it:

    [rid, index, text_delta, token_ids, logprobs, finish_reason, error, prompt_tokens, cached_tokens,
     spec_verify_ct, spec_verify_tokens, prompt_logprobs, matched_stop]

where each logprobs entry is ``[token_id, token_bytes, logprob, [[id, bytes, logprob], ...]]``.
REJECT goes to its request's API server; STATS and FATAL to every API server; READY to API server 0.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import zmq

from kiln.runtime.sampling import SamplingParams
from kiln.runtime.startup import StartupTimer, process_phases
from kiln.runtime.text.text_stream import SampleText
from kiln.runtime.text.token_bytes import TokenBytes
from kiln.runtime.text.tokenizer import Tokenizer
from kiln.server import ipc

log = logging.getLogger("kiln.server.detokenizer")


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.token_bytes = tokenizer.token_bytes if tokenizer is not None else TokenBytes(None)
        self._texts: dict[str, list[SampleText | None]] = {}
        self._open: dict[str, int] = {}  # samples of each request not finished yet
        self._origin: dict[str, int] = {}  # the API server each request came from

    def add(self, rid: str, prompt_tail: list[int], params: dict[str, Any], origin: int = 0) -> None:
        sampling = SamplingParams(**params)
        make = (lambda: SampleText(self.tokenizer, prompt_tail, sampling)) if self.tokenizer else (lambda: None)
        self._texts[rid] = [make() for _ in range(sampling.n)]
        self._open[rid] = sampling.n
        self._origin[rid] = origin

    def outputs(self, events: list[list[Any]]) -> dict[int, list[list[Any]]]:
        """The events' outputs, grouped by the API server their requests came from."""
        by_origin: dict[int, list[list[Any]]] = {}
        for event in events:
            origin = self._origin.get(event[0], 0)  # read before _output forgets a finished request
            by_origin.setdefault(origin, []).append(self._output(*event))
        return by_origin

    def _output(self, rid: str, index: int, token_ids: list[int], logprobs: list[list[Any]], finish_reason: str | None,
                error: str | None, prompt_tokens: int, cached_tokens: int, spec_verify_ct: int,
                spec_verify_tokens: int, prompt_logprobs: list[float], matched_stop: int | str | None) -> list[Any]:
        texts = self._texts.get(rid)
        sample = texts[index] if texts is not None else None
        text = sample.push(token_ids, finish_reason is not None) if sample is not None else ""
        if finish_reason is not None and rid in self._open:
            self._open[rid] -= 1
            if self._open[rid] == 0:
                del self._open[rid], self._texts[rid], self._origin[rid]
        named = [[token, self.token_bytes.bytes_of(token), value,
                  [[alt, self.token_bytes.bytes_of(alt), alt_value] for alt, alt_value in top]]
                 for token, value, top in logprobs]
        return [rid, index, text, token_ids, named, finish_reason, error, prompt_tokens, cached_tokens, spec_verify_ct,
                spec_verify_tokens, prompt_logprobs, matched_stop]


def run(inbox: zmq.Socket, outboxes: list[zmq.Socket], parent: ipc.ParentWatch, tokenizer: Tokenizer | None,
        startup: StartupTimer) -> int:
    """``outboxes``: one per API server, in order (API server 0 is the launcher)."""
    detokenizer = Detokenizer(tokenizer)
    phases = startup.to_wire()  # sent with the first READY
    while parent.alive():
        for message in ipc.recv_ready(inbox, ipc.IDLE_POLL_MS):
            kind = message[0]
            if kind == ipc.EVENTS:
                for origin, outputs in detokenizer.outputs(message[1]).items():
                    outboxes[origin].send(ipc.pack([ipc.OUTPUTS, outputs]))
            elif kind == ipc.NEW:
                detokenizer.add(*message[1:])
            elif kind == ipc.READY:
                message[1]["startup"] = message[1].get("startup", []) + phases
                phases = []
                outboxes[0].send(ipc.pack(message))
            elif kind == ipc.REJECT:
                outboxes[message[4]].send(ipc.pack(message))
            elif kind in (ipc.STATS, ipc.FATAL):
                data = ipc.pack(message)
                for outbox in outboxes:
                    outbox.send(data)
            elif kind == ipc.SHUTDOWN:
                return 0
            else:
                log.warning("ignoring an unexpected message %r", kind)
    log.info("the server process is gone; exiting")
    return 0


def main(argv: list[str] | None = None) -> int:
    main_at = time.time()
    args = argv if argv is not None else sys.argv[1:]
    with ipc.worker_process(args, "detokenizer", ipc.DETOKENIZER_SOCKET, ipc.http_socket(0)) as (config, inbox, outbox):
        outboxes = [outbox, *(ipc.push_socket(outbox.context, ipc.address(config["ipc_dir"], ipc.http_socket(i)))
                              for i in range(1, config.get("api_servers", 1)))]
        try:
            startup = process_phases("detokenizer", main_at, config.get("spawned_at"))
            with startup.phase("tokenizer"):
                tokenizer = Tokenizer.from_dir(config["tokenizer_dir"]) if config.get("tokenizer_dir") else None
            return run(inbox, outboxes, ipc.ParentWatch(config["parent_pid"]), tokenizer, startup)
        except Exception as exc:
            log.exception("the detokenizer failed")
            for target in outboxes:
                target.send(ipc.pack([ipc.FATAL, f"the detokenizer failed: {type(exc).__name__}: {exc}"]))
            return 1
        finally:
            for extra in outboxes[1:]:
                extra.close()


if __name__ == "__main__":
    ipc.exit_now(main())
