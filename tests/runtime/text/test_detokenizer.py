"""Incremental detokenization and stop strings, on a SentencePiece-style byte-fallback tokenizer
built here and on the real SmolLM2 (byte-level BPE) tokenizer."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from kiln.runtime.text.detokenizer import (ByteLevelDetokenizer, IncrementalDetokenizer, StopChecker,
                                          detokenizer_for, find_stop, find_stop_regex, partial_stop_length)
from kiln.runtime.text.tokenizer import Tokenizer

TEXTS = [
    "Hello world, café 你好 😀 naïve",
    "Emoji run: 😀😃😄 👍🏽 👨‍👩‍👧 end",
    "日本語のテキストと中文混合 with English",
    "Accents: Zürich, São Paulo, Ångström, façade, œuvre",
    "  two leading spaces and trailing  ",
    "Hello the world\n\nnew paragraph\twith tab",
    "ÿ þ ß and a lone é",
]


def byte_fallback_tokenizer() -> Tokenizer:
    """A Llama-2-style SentencePiece BPE: '▁' for spaces, a leading '▁' prepended and stripped on
    decode, and <0xNN> byte tokens for every character outside its small vocabulary."""
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    chars = list("▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-:é")
    vocab = {token: i for i, token in enumerate(specials + byte_tokens + chars)}
    merges = []
    for word in ["▁Hello", "▁world", "▁the", "▁café", "ing"]:
        merged = word[0]
        for char in word[1:]:
            merges.append((merged, char))
            merged += char
            vocab.setdefault(merged, len(vocab))
    backend = BackendTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(specials)
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def sentencepiece() -> Tokenizer:
    return byte_fallback_tokenizer()


@pytest.fixture(scope="module")
def smollm2(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


def stream(tokenizer: Tokenizer, ids: list[int], chunk_sizes: list[int] | None = None, **kwargs) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas, position = [], 0
    for size in chunk_sizes or [1] * len(ids):
        deltas.append(detokenizer.add(ids[position:position + size] if size > 1 else ids[position]))
        position += size
    deltas.append(detokenizer.finish())
    assert detokenizer.text == "".join(deltas)
    assert detokenizer.output_ids == ids
    return deltas


def random_chunks(total: int, rng: random.Random) -> list[int]:
    sizes = []
    while total > 0:
        sizes.append(min(total, rng.randint(1, 4)))
        total -= sizes[-1]
    return sizes


@pytest.mark.parametrize("name", ["sentencepiece", "smollm2"])
def test_streaming_joins_to_decode_without_replacement_chars(name, request):
    tokenizer = request.getfixturevalue(name)
    rng = random.Random(0)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        expected = tokenizer.decode(ids)
        for chunks in (None, random_chunks(len(ids), rng)):
            deltas = stream(tokenizer, ids, chunks)
            assert "".join(deltas) == expected, text
            assert not any("\ufffd" in d for d in deltas), (text, deltas)


def test_byte_fallback_characters_are_held_until_complete(sentencepiece):
    ids = sentencepiece.encode("a😀", add_special_tokens=False)
    tokens = sentencepiece.convert_ids_to_tokens(ids)
    assert tokens[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    deltas = stream(sentencepiece, ids)
    assert deltas[-5:] == ["", "", "", "😀", ""]


def test_naive_concatenation_would_lose_spaces(sentencepiece):
    ids = sentencepiece.encode("Hello world the", add_special_tokens=False)
    assert "".join(sentencepiece.decode([i]) for i in ids) == "Helloworldthe"
    assert stream(sentencepiece, ids) == ["Hello", " world", " the", ""]


def test_prompt_context_keeps_the_first_leading_space(sentencepiece):
    prompt = sentencepiece.encode("Hello")
    output = sentencepiece.encode("world", add_special_tokens=False)
    assert "".join(stream(sentencepiece, output, prompt_ids=prompt)) == " world"
    assert "".join(stream(sentencepiece, output)) == "world"


def test_truly_invalid_bytes_come_out_at_the_end(sentencepiece):
    byte = sentencepiece.token_to_id
    deltas = stream(sentencepiece, [byte("a"), byte("<0xE4>"), byte("<0xBD>")])
    assert deltas == ["a", "", "", sentencepiece.decode([byte("<0xE4>"), byte("<0xBD>")])]
    assert deltas[-1].startswith("\ufffd")
    # Invalid bytes followed by text cannot become valid: they are emitted with that text.
    deltas = stream(sentencepiece, [byte("<0xFF>"), byte("a")])
    assert "".join(deltas) == "\ufffda" and deltas[-1] == ""


def test_special_tokens_skipped_or_kept(sentencepiece):
    ids = sentencepiece.encode("Hello", add_special_tokens=False) + [sentencepiece.eos_token_id]
    assert "".join(stream(sentencepiece, ids)) == "Hello"
    assert "".join(stream(sentencepiece, ids, skip_special_tokens=False)) == "Hello</s>"


def test_smollm2_streams_chat_output_after_prompt(smollm2):
    prompt = smollm2.encode_chat([{"role": "user", "content": "Hi"}])
    output = smollm2.encode("Bonjour ! 👋 Ça va ?", add_special_tokens=False) + [smollm2.eos_token_id]
    deltas = stream(smollm2, output, prompt_ids=prompt)
    assert "".join(deltas) == "Bonjour ! 👋 Ça va ?"
    assert not any("\ufffd" in d for d in deltas)


# --- the byte-level detokenizer ------------------------------------------------------------------

def byte_level_stream(tokenizer: Tokenizer, ids: list[int], chunk_sizes: list[int], skip: bool) -> str:
    detokenizer = detokenizer_for(tokenizer, skip_special_tokens=skip)
    deltas, position = [], 0
    for size in chunk_sizes:
        deltas.append(detokenizer.add(ids[position:position + size] if size > 1 else ids[position]))
        position += size
    return "".join(deltas) + detokenizer.finish()


def test_smollm2_takes_the_byte_level_detokenizer_and_sentencepiece_the_window(smollm2, sentencepiece):
    assert smollm2.decodes_bytes and isinstance(detokenizer_for(smollm2), ByteLevelDetokenizer)
    assert not sentencepiece.decodes_bytes
    assert isinstance(detokenizer_for(sentencepiece), IncrementalDetokenizer)


def test_byte_level_deltas_join_to_decode_of_any_ids(smollm2):
    """Random ids (partial UTF-8 characters, lone continuation bytes, special tokens), fed one and
    several at a time, with special tokens skipped and kept: the deltas join to what the tokenizers
    library decodes, replacement characters included."""
    rng = random.Random(1)
    byte_tokens = [smollm2.token_to_id(char) for char in ("Ã", "Â", "ð", "Ł", "¤", "Ċ")]
    for _ in range(400):
        ids = [rng.choice([rng.randrange(smollm2.vocab_size), rng.choice(byte_tokens), rng.randrange(17)])
               for _ in range(rng.randint(1, 24))]
        for skip in (True, False):
            streamed = byte_level_stream(smollm2, ids, random_chunks(len(ids), rng), skip)
            assert streamed == smollm2.decode_raw(ids, skip), ids


def test_byte_level_holds_a_character_until_its_last_byte(smollm2):
    ids = smollm2.encode("a😀", add_special_tokens=False)
    detokenizer = ByteLevelDetokenizer(smollm2)
    assert "".join(detokenizer.add(i) for i in ids) == "a😀"
    cut = ByteLevelDetokenizer(smollm2)
    assert cut.add(smollm2.token_to_id("ð")) == ""  # the first of four bytes
    assert cut.finish() == "\ufffd"


def test_added_tokens_outside_the_byte_alphabet_still_decode_as_the_library_does():
    """A byte-level tokenizer with added tokens spelled with a space and with Latin-1 letters: whichever
    detokenizer ``detokenizer_for`` picks, its text is the library's decode."""
    alphabet = {char: i for i, char in enumerate(sorted(set("abcdefgh Ġ!")))}
    backend = BackendTokenizer(models.BPE(alphabet, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens(["two words", "café"])
    backend.add_special_tokens(["<|end|>"])
    tokenizer = Tokenizer(backend, eos_token="<|end|>")
    ids = [alphabet["a"], backend.token_to_id("two words"), alphabet["Ġ"], backend.token_to_id("café"),
           backend.token_to_id("<|end|>"), alphabet["b"]]
    for skip in (True, False):
        assert byte_level_stream(tokenizer, ids, [1] * len(ids), skip) == tokenizer.decode_raw(ids, skip)


# --- stop strings --------------------------------------------------------------------------------

def run_stops(stops: list[str], deltas: list[str]) -> tuple[list[str], StopChecker]:
    checker = StopChecker(stops)
    streamed = []
    for delta in deltas:
        update = checker.push(delta)
        streamed.append(update.text)
        if update.stopped:
            return streamed, checker
    streamed.append(checker.flush())
    return streamed, checker


def test_stop_string_split_across_deltas():
    streamed, checker = run_stops(["STOP"], ["Hel", "lo ST", "OP and more"])
    assert streamed == ["Hel", "lo ", ""]
    assert checker.stopped and checker.text == "Hello "


def test_held_tail_is_released_when_it_stops_matching():
    streamed, checker = run_stops(["STOP"], ["ab", "S", "T", "x", "y"])
    assert streamed == ["ab", "", "", "STx", "y", ""]
    assert not checker.stopped and checker.text == "abSTxy"


def test_flush_releases_held_tail_at_the_end():
    streamed, checker = run_stops(["</answer>"], ["The answer is 4</"])
    assert streamed == ["The answer is 4", "</"]


def test_earliest_of_several_stops_wins_and_reports_which():
    checker = StopChecker(["world", "lo w"])
    update = checker.push("hello world")
    assert update.stopped and update.stop_string == "lo w" and checker.text == "hel" and update.text == "hel"


def test_stop_at_the_very_start():
    streamed, checker = run_stops(["\n\n"], ["\n", "\nrest"])
    assert streamed == ["", ""] and checker.text == ""


def test_push_after_stop_is_an_error():
    checker = StopChecker(["x"])
    checker.push("x")
    with pytest.raises(RuntimeError):
        checker.push("more")


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError):
        StopChecker(["ok", ""])


def test_find_stop_and_partial_length():
    assert find_stop("abcSTOPdef", ["STOP"]) == (3, "STOP")
    assert find_stop("abcSTOPdef", ["STOP"], start=8) is None  # already checked up to 8
    assert find_stop("abcSTOPdef", ["STOP"], start=6) == (3, "STOP")
    assert partial_stop_length("abcST", ["STOP"]) == 2
    assert partial_stop_length("abcSTOX", ["STOP"]) == 0
    assert partial_stop_length("aaa", ["aab", "aaaa"]) == 3
    assert partial_stop_length("", ["x"]) == 0


# --- stop regexes --------------------------------------------------------------------------------

def test_stop_regex_matches_across_deltas_and_cuts_before_the_match():
    checker = StopChecker([], [r"\d{3}"])
    assert [checker.push(d).text for d in ["call 5", "5", "5 now"]] == ["call 5", "5", ""]
    assert checker.stopped and checker.stop_string == r"\d{3}"
    # The match began in streamed text ("55"): what was streamed stays, the cut falls after it.
    assert checker.text == "call 55"


def test_stop_regex_match_in_one_delta_is_cut_where_it_begins():
    checker = StopChecker([], [r"P[a-z]+s"])
    assert checker.push("The capital is").text == "The capital is"
    update = checker.push(" Paris.")
    assert update.stopped and update.text == " " and update.stop_string == r"P[a-z]+s"
    assert checker.text == "The capital is "


def test_earliest_of_stop_strings_and_regexes_wins():
    update = StopChecker(["world"], [r"l+o"]).push("hello world")
    assert update.stop_string == r"l+o" and update.text == "he"
    update = StopChecker(["he"], [r"l+o"]).push("hello world")
    assert update.stop_string == "he" and update.text == ""


def test_stop_regex_that_never_matches_releases_everything():
    streamed, checker = [], StopChecker([], [r"^zzz"])
    streamed = [checker.push(d).text for d in ["zz", "top zzz"]] + [checker.flush()]
    assert streamed == ["zz", "top zzz", ""] and not checker.stopped


def test_find_stop_regex_searches_the_whole_text():
    import re
    patterns = [re.compile(r"b+c"), re.compile(r"a.c")]
    assert find_stop_regex("xxabbc", patterns) == (3, r"b+c")
    assert find_stop_regex("xxabc", patterns) == (2, r"a.c")
    assert find_stop_regex("xyz", patterns) is None


def test_stops_on_multibyte_text_never_split_characters(smollm2):
    text = "Answer: 你好😀世界 done"
    ids = smollm2.encode(text, add_special_tokens=False)
    for stop in ["😀", "好😀世", "界 d", "😀世界 done!"]:
        detokenizer, checker = IncrementalDetokenizer(smollm2), StopChecker([stop])
        streamed = []
        for token_id in ids:
            update = checker.push(detokenizer.add(token_id))
            streamed.append(update.text)
            if update.stopped:
                break
        else:
            streamed.append(checker.push(detokenizer.finish()).text + checker.flush())
        expected = text[:text.index(stop)] if stop in text else text
        assert "".join(streamed) == checker.text == expected
        assert not any("\ufffd" in s for s in streamed)
