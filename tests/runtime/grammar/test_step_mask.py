"""StepMasks: a step's bitmask from reused buffers equals one freshly allocated and filled row by row,
step after step, as rows change between constrained, unconstrained and absent and the batch grows
past the buffer, filled on the calling thread or on the filler thread (``start``, overlapped steps),
by xgrammar on one thread or on two (one per 16 rows: the 17-row step);
on CUDA, from pinned buffers in turn with one copy to the device."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.grammar import GrammarState, allocate_bitmask
from kiln.runtime.grammar.step_mask import BACKGROUND_MIN_ROWS, StepMasks

from .conftest import PADDED_VOCAB

EOS = 2


def row_by_row(states: list[GrammarState | None]) -> torch.Tensor:
    """The reference: a new all-allowed mask, each constrained row filled on its own."""
    bitmask = allocate_bitmask(len(states), PADDED_VOCAB)
    for row, state in enumerate(states):
        if state is not None:
            state.fill_bitmask(bitmask, row)
    return bitmask


def walks(grammar_compiler, random_walk) -> list[tuple[GrammarState, list[int]]]:
    """States of a JSON schema, a regex and an EBNF grammar, each with a full walk of its tokens."""
    # Bounded grammars: a uniform random walk ends within a few tokens.
    grammars = [grammar_compiler.compile("json_schema", {"type": "object", "properties": {
                    "k": {"type": "string", "maxLength": 6}}, "required": ["k"]}),
                grammar_compiler.compile("regex", "[a-z]{2,6}( [0-9]{1,3})?"),
                grammar_compiler.compile("ebnf", 'root ::= "(" [0-9] ("+" [0-9]){0,3} ")"')]
    return [(GrammarState(g), random_walk(GrammarState(g), seed)) for seed, g in enumerate(grammars)]


def run_steps(masks: StepMasks, grammar_compiler, random_walk, layouts: list[list[int | None]],
              background: bool = False) -> None:
    """Step the walks along; ``layouts[step][row]`` says which walk's state row ``row`` holds (None:
    an unconstrained row). Every step's mask must equal the row-by-row reference."""
    states = walks(grammar_compiler, random_walk)
    for step, layout in enumerate(layouts):
        live = [states[w][0] if w is not None and not states[w][0].is_terminated() else None for w in layout]
        if background:
            pending = masks.start(live)
            got = None if pending is None else pending.wait()
        else:
            got = masks.fill(live)
        if not any(live):
            assert got is None
        else:
            assert got.shape == (len(layout), (PADDED_VOCAB + 31) // 32)
            assert torch.equal(got.cpu(), row_by_row(live)), f"step {step}"
        for state, tokens in states:
            if state.num_accepted < len(tokens):
                assert state.accept(tokens[state.num_accepted])


LAYOUTS = [[0, 1, 2], [None, 1, 0], [2, None], [None, None, None], [0], [0, 1, 2, None, None, 1],
           list(range(3)) * 4 + [None] * 5, [None, 2, None, 1], [1, 0, 2]]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("background", [False, True], ids=["here", "filler-thread"])
def test_reused_buffers_give_the_row_by_row_masks(grammar_compiler, random_walk, background, threads):
    masks = StepMasks(PADDED_VOCAB, "cpu", threads)
    run_steps(masks, grammar_compiler, random_walk, LAYOUTS, background)
    assert masks._host[0].mask.shape[0] == 32  # grown once, from 4 rows to the next power of two above 17


def test_a_background_fill_raises_its_error_at_wait(grammar_compiler, random_walk):
    # A terminated state has no next token: the filler thread's error reaches the waiting caller.
    state, tokens = walks(grammar_compiler, random_walk)[1]
    for token in tokens:
        assert state.accept(token)
    assert state.is_terminated()
    pending = StepMasks(PADDED_VOCAB, "cpu").start([state] * BACKGROUND_MIN_ROWS)
    with pytest.raises(RuntimeError, match="terminated"):
        pending.wait()


@pytest.mark.gpu
def test_pinned_buffers_in_turn_and_one_device_copy(grammar_compiler, random_walk):
    masks = StepMasks(PADDED_VOCAB, "cuda")
    run_steps(masks, grammar_compiler, random_walk, LAYOUTS)
    assert len(masks._host) == 2 and all(buffer.mask.is_pinned() for buffer in masks._host)
