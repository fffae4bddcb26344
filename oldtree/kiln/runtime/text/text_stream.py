"""Text for one sample as its tokens arrive: detokenized deltas with stop strings (and stop regexes)
cut and held back.

The engine core decides *when* a stop string ends a request; this produces the text the user sees
from the same tokens (the in-process Engine and the server's detokenizer process both use it), so
both sides agree on where the output ends.
"""

from __future__ import annotations

from typing import Sequence

from ..sampling import SamplingParams
from .detokenizer import StopChecker, detokenizer_for
from .tokenizer import Tokenizer


class SampleText:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self._detok = detokenizer_for(tokenizer, prompt_ids, params.skip_special_tokens)
        self._stop = StopChecker(params.stop, params.stop_regex) if params.stop or params.stop_regex else None
        self.text = ""
        self.stop_string: str | None = None

    def push(self, token_ids: Sequence[int], finished: bool) -> str:
        """The text that may be shown after these tokens (all that remains, once ``finished``)."""
        delta = self._detok.add(token_ids) if token_ids else ""
        if finished:
            delta += self._detok.finish()
        if self._stop is None:
            visible = delta
        elif self._stop.stopped:
            visible = ""
        else:
            update = self._stop.push(delta)
            visible = update.text
            if update.stopped:
                self.stop_string = update.stop_string
            elif finished:
                visible += self._stop.flush()
        self.text += visible
        return visible
