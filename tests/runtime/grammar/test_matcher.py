"""GrammarState: stop tokens only where the grammar may end, termination, rejection, and rebuilding a
state (replay from tokens, rollback) that gives exactly the masks the original gave."""

from __future__ import annotations

import logging

import pytest
import torch

from kiln.runtime.grammar import GrammarState, allocate_bitmask

from .conftest import PADDED_VOCAB, allowed_ids

EOS = 2  # SmolLM2's <|im_end|>
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "items": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
    "required": ["name", "n", "items"],
}


def mask_of(state: GrammarState) -> torch.Tensor:
    bitmask = allocate_bitmask(1, PADDED_VOCAB)
    state.fill_bitmask(bitmask, 0)
    return bitmask[0].clone()


def accept_text(state: GrammarState, tokenizer, text: str) -> None:
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert state.accept(token)


def test_stop_token_is_allowed_only_where_the_grammar_may_end(grammar_compiler, smollm2_tokenizer):
    state = GrammarState(grammar_compiler.compile("regex", "[0-9]{2,3}"))
    accept_text(state, smollm2_tokenizer, "4")
    assert EOS not in allowed_ids(mask_of(state).numpy(), PADDED_VOCAB) and not state.is_completed()
    accept_text(state, smollm2_tokenizer, "2")
    allowed = allowed_ids(mask_of(state).numpy(), PADDED_VOCAB).tolist()
    assert EOS in allowed and len(allowed) == 11 and state.is_completed()  # a third digit, or stop
    accept_text(state, smollm2_tokenizer, "7")
    assert allowed_ids(mask_of(state).numpy(), PADDED_VOCAB).tolist() == [EOS]
    assert not state.is_terminated()
    assert state.accept(EOS) and state.is_terminated() and state.num_accepted == 4


def test_a_terminated_state_has_no_mask_and_accepts_nothing(grammar_compiler, smollm2_tokenizer):
    state = GrammarState(grammar_compiler.compile("regex", "7"))
    accept_text(state, smollm2_tokenizer, "7")
    assert state.accept(EOS)
    with pytest.raises(RuntimeError, match="terminated"):
        mask_of(state)
    live = GrammarState(grammar_compiler.compile("regex", "7"))
    with pytest.raises(RuntimeError, match="terminated"):  # the batch fill checks every state too
        GrammarState.fill_bitmasks([live, state], allocate_bitmask(2, PADDED_VOCAB), [0, 1])
    assert not state.accept(EOS)
    assert state.num_accepted == 2


def test_request_stop_tokens_replace_the_default(grammar_compiler, smollm2_tokenizer):
    state = GrammarState(grammar_compiler.compile("regex", "ok"), stop_token_ids=[0, EOS])
    accept_text(state, smollm2_tokenizer, "ok")
    assert allowed_ids(mask_of(state).numpy(), PADDED_VOCAB).tolist() == [0, EOS]
    assert state.accept(0) and state.is_terminated()
    with pytest.raises(ValueError, match="at least one stop token"):
        GrammarState(grammar_compiler.compile("regex", "ok"), stop_token_ids=[])


def test_a_token_outside_the_grammar_is_rejected_and_changes_nothing(grammar_compiler, smollm2_tokenizer, caplog):
    state = GrammarState(grammar_compiler.compile("json_schema", SCHEMA))
    accept_text(state, smollm2_tokenizer, '{"name": "a')
    before = mask_of(state)
    with caplog.at_level(logging.WARNING, logger="kiln.runtime.grammar.matcher"):
        assert not state.accept(EOS)  # the string and the object are still open
    assert "grammar rejected token 2" in caplog.text
    assert torch.equal(mask_of(state), before)
    assert state.num_accepted == len(smollm2_tokenizer.encode('{"name": "a', add_special_tokens=False))


def test_replay_and_rollback_reproduce_every_mask(grammar_compiler, random_walk):
    grammar = grammar_compiler.compile("json_schema", SCHEMA)
    tokens = random_walk(GrammarState(grammar), seed=7)
    assert len(tokens) > 10
    stepping = GrammarState(grammar)
    masks = []
    for token in tokens[:-1]:
        masks.append(mask_of(stepping))
        assert stepping.accept(token)
    masks.append(mask_of(stepping))
    assert stepping.accept(tokens[-1]) and stepping.is_terminated()

    for prefix in range(len(tokens)):
        assert torch.equal(mask_of(GrammarState.replay(grammar, tokens[:prefix])), masks[prefix])
    assert GrammarState.replay(grammar, tokens).is_terminated()
    # Roll the finished state back step by step: each position gives its original mask again.
    for prefix in reversed(range(len(tokens))):
        stepping.rollback(1)
        assert not stepping.is_terminated() and stepping.num_accepted == prefix
        assert torch.equal(mask_of(stepping), masks[prefix])


def test_rollback_of_several_tokens_then_a_different_continuation(grammar_compiler, smollm2_tokenizer):
    grammar = grammar_compiler.compile("regex", "(cat|dog)s?")
    state = GrammarState(grammar)
    accept_text(state, smollm2_tokenizer, "cats")
    accepted = state.num_accepted
    state.rollback(accepted)
    assert torch.equal(mask_of(state), mask_of(GrammarState(grammar)))
    accept_text(state, smollm2_tokenizer, "dog")
    assert state.accept(EOS) and state.is_terminated()
    with pytest.raises(ValueError, match="cannot roll back 9 tokens"):
        state.rollback(9)


def test_replay_of_tokens_outside_the_grammar_fails(grammar_compiler, smollm2_tokenizer):
    grammar = grammar_compiler.compile("regex", "[0-9]+")
    tokens = smollm2_tokenizer.encode("12x", add_special_tokens=False)
    with pytest.raises(ValueError, match=r"output token 2 \(id \d+\) does not follow it"):
        GrammarState.replay(grammar, tokens)


@pytest.mark.parametrize("threads", [1, 4])
def test_batch_fill_equals_one_row_at_a_time(grammar_compiler, threads):
    """fill_bitmasks (xgrammar's batch fill, on one thread or three: one per 16 of the 39 rows) writes
    the rows the single-row fill writes."""
    schemas = ['{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}',
               '{"type": "array", "items": {"type": "string"}}', '{"type": "boolean"}']
    # Distinct states (a matcher is filled by one thread at a time: its scratch buffers are its own).
    states = [GrammarState(grammar_compiler.compile("json_schema", s)) for _ in range(13) for s in schemas]
    rows = [(7 * i + 2) % 41 for i in range(len(states))]  # 39 of 41 rows, out of order
    batched = allocate_bitmask(41, PADDED_VOCAB)
    GrammarState.fill_bitmasks(states, batched, rows, threads)
    for state, row in zip(states, rows):
        single = allocate_bitmask(1, PADDED_VOCAB)
        state.fill_bitmask(single, 0)
        assert torch.equal(batched[row], single[0])
    for row in set(range(41)) - set(rows):  # untouched rows allow everything
        assert torch.equal(batched[row], allocate_bitmask(1, PADDED_VOCAB)[0])


def test_batch_accept_equals_one_row_at_a_time(grammar_compiler, random_walk):
    """accept_tokens (a whole step's states at once) gives each state exactly what accept gives it:
    the verdicts, the counts, termination and every later mask, including rejected tokens (a token
    outside the grammar, a token after the stop token) and states of several grammars in one batch."""
    grammars = [grammar_compiler.compile("json_schema", SCHEMA), grammar_compiler.compile("regex", "(cat|dog)s?"),
                grammar_compiler.compile("json_schema", '{"type": "boolean"}')]
    walks = [random_walk(GrammarState(grammar), seed=seed) for seed, grammar in enumerate(grammars)]
    # Each row's tokens: its walk, then a token after its end (rejected: it has terminated); row 1 is
    # also given a token outside its grammar at step 2, which both sides must reject alike.
    stepped = [GrammarState(g) for g in grammars]
    batched = [GrammarState(g) for g in grammars]
    outside = 4  # an id no grammar here allows after its first token
    for step in range(max(map(len, walks)) + 1):
        rows = [i for i, walk in enumerate(walks) if step <= len(walk)]
        tokens = [walks[i][step] if step < len(walks[i]) else EOS for i in rows]
        if step == 2:
            tokens[rows.index(1)] = outside
        expected = [stepped[i].accept(token) for i, token in zip(rows, tokens)]
        assert GrammarState.accept_tokens([batched[i] for i in rows], tokens) == expected
        if step == 2:
            assert not expected[rows.index(1)]
            assert stepped[1].accept(walks[1][2]) and batched[1].accept(walks[1][2])
        for i in rows:
            a, b = stepped[i], batched[i]
            assert (a.num_accepted, a.is_terminated(), a.is_completed()) == (b.num_accepted, b.is_terminated(),
                                                                             b.is_completed())
            if not a.is_terminated():
                assert torch.equal(mask_of(a), mask_of(b))
    assert all(state.is_terminated() for state in batched)


def test_termination_follows_the_matcher_through_accepts_and_rollbacks(grammar_compiler, random_walk):
    """is_terminated (tracked without asking the matcher) agrees with xgrammar's matcher at every
    position of a walk, after a rollback over the stop token, and after accepting it again."""
    grammar = grammar_compiler.compile("json_schema", SCHEMA)
    tokens = random_walk(GrammarState(grammar), seed=3)
    state = GrammarState(grammar)
    for token in tokens:
        assert state.accept(token)
        assert state.is_terminated() == state._matcher.is_terminated()
    assert state.is_terminated()
    for undo in (1, 3):
        state.rollback(undo)
        assert not state.is_terminated() and not state._matcher.is_terminated()
        for token in tokens[len(tokens) - undo:]:
            assert state.accept(token)
        assert state.is_terminated() and state._matcher.is_terminated()
