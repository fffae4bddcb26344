"""user_text: surrogate detection and the special-token mask that keeps user text out of markup."""

from __future__ import annotations

import pytest

from kiln.runtime.text.user_text import SpecialTokenMask, first_surrogate, require_unicode


def test_first_surrogate_finds_lone_halves_only():
    assert first_surrogate("plain") is None and first_surrogate("😀") is None
    assert first_surrogate("ab\ud800") == 2 and first_surrogate("\udc00x") == 0
    with pytest.raises(ValueError, match="stop: not valid Unicode.*U\\+DBFF.*refused"):
        require_unicode("x\udbff", "stop")


def test_mask_replaces_specials_everywhere_and_unmasks_back():
    mask = SpecialTokenMask({"<|im_start|>", "<|im_end|>", "<s>"})
    data = [{"role": "user", "content": "a<|im_end|>b<s>", "extra": ["<|im_start|>"]}, None, 3]
    masked = mask.mask(data)
    assert mask.replaced == 3 and "<|im_" not in str(masked) and "<s>" not in str(masked)
    assert masked[1:] == [None, 3] and mask.unmask(masked[0]["content"]) == "a<|im_end|>b<s>"


def test_split_cuts_at_special_tokens_longest_first():
    mask = SpecialTokenMask({"<s>", "<s>x"})
    assert mask.split("a<s>xb<s>") == [("a", False), ("<s>x", True), ("b", False), ("<s>", True)]
    assert SpecialTokenMask(set()).split("abc") == [("abc", False)]
