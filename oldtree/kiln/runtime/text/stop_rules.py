"""When a sample stops, decided token by token inside the engine core: the grammar's end, stop
token ids, EOS (unless ignored), stop strings and stop regexes (detected on the detokenized text;
the output side cuts the text itself), max_new_tokens and the context length. What ended a stopped
sample (the token id, the stop string or the regex's pattern) is its rules' ``matched``: SGLang's
``matched_stop``."""

from __future__ import annotations

from ..constraints import GRAMMAR, Constraints
from ..sampling import SamplingParams
from ..scheduler.request import Request
from .detokenizer import StopChecker, detokenizer_for
from .tokenizer import Tokenizer

STOP_RULES = "stop"


class StopWatch:
    """Stop-string and stop-regex detection for one sample."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self._detok = detokenizer_for(tokenizer, prompt_ids, params.skip_special_tokens)
        self._checker = StopChecker(params.stop, params.stop_regex)

    def push(self, token: int) -> str | None:
        """The stop string (or regex pattern) that this token completed, or None."""
        return self._checker.push(self._detok.add(token)).stop_string


class StopRules:
    """One sample's stop conditions other than its grammar's, worked out once when the request is
    added: the check after each token runs for every running sample every step, and this way it is
    a set lookup and a length comparison."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], eos_ids: set[int], max_seq_len: int,
                 tokenizer: Tokenizer | None) -> None:
        # Stop token ids, EOS among them unless ignored.
        self.token_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_ids))
        # Output tokens at which the sample ends: max_new_tokens, or fewer where the context ends.
        self.max_output = min(params.max_new_tokens, max_seq_len - len(prompt_ids))
        self.watch = StopWatch(tokenizer, prompt_ids, params) if params.stop or params.stop_regex else None
        # What ended the sample, once it stopped: a stop token id, a stop string or a regex pattern.
        self.matched: int | str | None = None


def finish_reason(request: Request, token: int) -> str | None:
    """Why ``request`` ends with ``token`` just appended: "stop", "length", "error" (the grammar
    rejected the token), or None to go on. The request's ``StopRules`` are in its extras; on a
    stop they record what matched. Its grammar, if any, is advanced over the token here."""
    # (checked here: a call per sample for the few constrained ones only)
    grammar_reason = Constraints.advance(request, token) if GRAMMAR in request.extras else None
    return finish_reason_after_grammar(request, token, grammar_reason)


def finish_reason_after_grammar(request: Request, token: int, grammar_reason: str | None) -> str | None:
    """``finish_reason`` for a request whose grammar (if any) the caller has already advanced over
    ``token``, all of a step's rows at once (``Constraints.advance_all``), with this verdict."""
    rules: StopRules = request.extras[STOP_RULES]
    if grammar_reason is not None:
        if grammar_reason == "stop" and token in rules.token_ids:
            rules.matched = token  # the grammar ended on EOS
        return grammar_reason
    if token in rules.token_ids:
        rules.matched = token
        return "stop"
    if rules.watch is not None:
        stop_string = rules.watch.push(token)
        if stop_string is not None:
            rules.matched = stop_string
            return "stop"
    if len(request.output_ids) >= rules.max_output:
        return "length"
    return None


def matched_stop(request: Request) -> int | str | None:
    """What ended ``request`` (a sample that finished "stop"): see ``StopRules.matched``."""
    return request.extras[STOP_RULES].matched


def sampled_on_device(request: Request) -> bool:
    """This request's next token can be chosen on the device and stay there (the decode graph's
    argmax, ``masked_argmax`` or the sampler, which needs only the row's params, seed and step), so
    its next step can be launched before the token is read. Not with penalties (they read the token
    history, whose last entry is still in flight) or logprobs (read back with the token)."""
    p = request.params
    return (not p.logprobs and not p.top_logprobs and p.repetition_penalty == 1 and not p.frequency_penalty
            and not p.presence_penalty)
