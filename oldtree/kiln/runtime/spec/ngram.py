"""The n-gram drafter (prompt lookup decoding): drafts copied from the request's own tokens.

The longest suffix of the request's tokens (prompt + output), between ``min_window`` and
``max_window`` tokens, that also occurs earlier is looked up; the tokens that followed its latest
earlier occurrence are the draft, a chain of at most ``num_draft_tokens``. No draft model: text that
repeats itself (lists, code, quoting the prompt) drafts well, anything else drafts nothing, and a
request with no draft decodes one token as it would without speculation.
"""

from __future__ import annotations

from typing import Sequence


class NgramDrafter:
    def __init__(self, min_window: int, max_window: int, num_draft_tokens: int) -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(f"n-gram window: need 1 <= min <= max, got {min_window} and {max_window}")
        self.min_window = min_window
        self.max_window = max_window
        self.num_draft_tokens = num_draft_tokens

    def propose(self, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        """Draft tokens to follow ``tokens`` (at most ``limit``, default ``num_draft_tokens``); [] when
        no suffix of the window's lengths occurs earlier."""
        limit = self.num_draft_tokens if limit is None else min(limit, self.num_draft_tokens)
        length = len(tokens)
        if limit <= 0 or length < 2:
            return []
        last = tokens[-1]
        # Candidate ends: the earlier positions of the last token, latest first; each one's match
        # length (how far the suffix agrees backwards from it) decides, the longest winning.
        best_end, best_len = -1, 0
        longest = min(self.max_window, length - 1)
        for end in range(length - 2, -1, -1):
            if tokens[end] != last:
                continue
            matched = 1
            while matched < longest and end - matched >= 0 and tokens[end - matched] == tokens[-1 - matched]:
                matched += 1
            if matched > best_len:
                best_end, best_len = end, matched
                if matched == longest:
                    break
        if best_len < self.min_window:
            return []
        return list(tokens[best_end + 1:best_end + 1 + limit])
