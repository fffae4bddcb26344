"""Prompt lookup: the longest suffix (within the window) found earlier, its latest occurrence, the
tokens after it as the draft."""

from __future__ import annotations

import pytest

from kiln.runtime.spec.ngram import NgramDrafter


def test_longest_suffix_wins_over_a_later_shorter_match():
    # Suffix [1, 2, 3] occurs at 0..2 (followed by 7, 8); [2, 3] alone later at 5..6 (followed by 9).
    tokens = [1, 2, 3, 7, 8, 2, 3, 9, 1, 2, 3]
    assert NgramDrafter(1, 4, 3).propose(tokens) == [7, 8, 2]
    # With a window of 2 both match as long: the latest occurrence wins.
    assert NgramDrafter(1, 2, 3).propose(tokens) == [9, 1, 2]


def test_draft_length_limits_and_the_end_of_the_tokens():
    tokens = [5, 6, 7, 8, 5, 6]
    drafter = NgramDrafter(1, 3, 8)
    assert drafter.propose(tokens) == [7, 8, 5, 6]          # only what follows the match exists
    assert drafter.propose(tokens, limit=2) == [7, 8]
    assert drafter.propose(tokens, limit=0) == []
    assert NgramDrafter(1, 3, 1).propose(tokens) == [7]     # num_draft_tokens caps the chain


def test_no_match_or_too_short_a_match_drafts_nothing():
    assert NgramDrafter(1, 3, 4).propose([1, 2, 3, 4]) == []
    assert NgramDrafter(1, 3, 4).propose([4]) == []
    # The suffix [9, 4] matches only its last token earlier: below a minimum window of 2.
    assert NgramDrafter(2, 3, 4).propose([4, 1, 9, 4]) == []
    assert NgramDrafter(1, 3, 4).propose([4, 1, 9, 4]) == [1, 9, 4]


def test_repetitive_list_drafts_its_continuation():
    tokens = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11]
    assert NgramDrafter(1, 12, 4).propose(tokens) == [12, 13, 10, 11]


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="min <= max"):
        NgramDrafter(3, 2, 4)
