"""Fixtures for the grammar tests: SmolLM2's tokenizer, a compiler over a padded logits width, and a
random walk that samples uniformly among the tokens a grammar allows until it terminates."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from kiln.runtime.grammar import GrammarCompiler, GrammarState, allocate_bitmask
from kiln.runtime.text.tokenizer import Tokenizer

# SmolLM2's tokenizer has 49152 ids; 20 padding rows make the logits width a non-multiple of 32.
PADDED_VOCAB = 49152 + 20
MAX_WALK_STEPS = 4000


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="session")
def grammar_compiler(smollm2_tokenizer) -> GrammarCompiler:
    compiler = GrammarCompiler(smollm2_tokenizer, PADDED_VOCAB)
    yield compiler
    compiler.close()


@pytest.fixture
def new_compiler(smollm2_tokenizer) -> Callable[..., GrammarCompiler]:
    """A factory of compilers with their own (empty) caches, closed after the test."""
    made: list[GrammarCompiler] = []

    def make(**options) -> GrammarCompiler:
        made.append(GrammarCompiler(smollm2_tokenizer, PADDED_VOCAB, **options))
        return made[-1]

    yield make
    for compiler in made:
        compiler.close()


def allowed_ids(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The ids a bitmask row allows (numpy: one thread, so fast even on a loaded machine)."""
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


@pytest.fixture(scope="session")
def random_walk(smollm2_tokenizer) -> Callable[[GrammarState, int], list[int]]:
    """Walk a state to termination, choosing each token uniformly among those its mask allows, and
    check on the way that the mask never allows padding ids or non-stop special tokens."""
    special = np.array(sorted(smollm2_tokenizer.special_token_ids - smollm2_tokenizer.eos_token_ids))

    def walk(state: GrammarState, seed: int) -> list[int]:
        rng = np.random.default_rng(seed)
        bitmask = allocate_bitmask(1, PADDED_VOCAB)
        tokens: list[int] = []
        while not state.is_terminated():
            assert len(tokens) < MAX_WALK_STEPS, f"no termination after {MAX_WALK_STEPS} tokens"
            state.fill_bitmask(bitmask, 0)
            choices = allowed_ids(bitmask[0].numpy(), PADDED_VOCAB)
            assert len(choices) > 0, "the mask allows no token"
            assert choices[-1] < smollm2_tokenizer.vocab_size, "the mask allows a padding id"
            assert not np.intersect1d(choices, special).size, "the mask allows a special token"
            token = int(rng.choice(choices))
            assert state.accept(token), f"an allowed token {token} was rejected"
            tokens.append(token)
        return tokens

    return walk


@pytest.fixture(scope="session")
def walk_text(smollm2_tokenizer, random_walk) -> Callable[[GrammarState, int], str]:
    """The text of a random walk: its tokens decoded, without the final stop token."""

    def text(state: GrammarState, seed: int) -> str:
        tokens = random_walk(state, seed)
        assert tokens[-1] in smollm2_tokenizer.eos_token_ids
        return smollm2_tokenizer.decode(tokens[:-1])

    return text
