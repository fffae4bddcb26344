"""The step schema as data: its checks, its derived views and its JSON round trip (the manifest's
``runtime.step_schema``). What derives from it end to end is tested in tests/runtime/worker."""

from __future__ import annotations

import pytest

from kiln.step_schema import (HIDDEN_STATES, LOGITS, PAD_TOKEN_COUNT, SEQUENCE, STEP_SCHEMA, TOKEN, StepField,
                              StepOutput, StepSchema)

ADAPTER = StepField("adapter_index", SEQUENCE, 0, "which adapter each sequence uses")


def test_the_default_schema_is_the_models_step_inputs():
    assert STEP_SCHEMA.names == ("token_ids", "positions", "slots", "q_start", "q_len", "kv_len", "page_table",
                                 "logits_index")
    assert STEP_SCHEMA.size_fields() == {"T": "token_ids", "B": "q_start", "N": "logits_index"}
    assert [f.name for f in STEP_SCHEMA.tables()] == ["page_table"]
    assert STEP_SCHEMA["page_table"].shape == ("B", "P")
    assert STEP_SCHEMA.outputs == (LOGITS,)


def test_padding_values():
    assert STEP_SCHEMA["slots"].pad_value(token_count=9) == -1
    assert STEP_SCHEMA["q_start"].pad == PAD_TOKEN_COUNT and STEP_SCHEMA["q_start"].pad_value(token_count=9) == 9


def test_a_field_and_an_output_are_added_in_one_place():
    schema = STEP_SCHEMA.with_fields(ADAPTER).with_outputs(HIDDEN_STATES)
    assert schema.names[-1] == "adapter_index" and schema.on(SEQUENCE)[-1] == ADAPTER
    assert schema.outputs == (LOGITS, HIDDEN_STATES)
    assert StepSchema.from_json(schema.to_json()) == schema


@pytest.mark.parametrize("make, message", [
    (lambda: STEP_SCHEMA.with_fields(StepField("slots", TOKEN, 0, "again")), "declares slots more than once"),
    (lambda: StepField("x", "Q", 0, "bad axis"), "axis must be one of T, B, N"),
    (lambda: StepField("x", TOKEN, "one", "bad pad"), "pad must be an int or 'token_count'"),
    (lambda: StepSchema(STEP_SCHEMA.fields, (HIDDEN_STATES,)), "first output is the logits"),
    (lambda: StepSchema(tuple(f for f in STEP_SCHEMA.fields if f.axis != "N")), "no vector along N"),
])
def test_bad_schemas_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_an_unknown_field_is_named():
    with pytest.raises(KeyError, match="no step field 'adapter'; the schema has token_ids"):
        STEP_SCHEMA["adapter"]


def test_outputs_are_data():
    assert StepOutput("logits", "x").to_json() == {"name": "logits", "doc": "x", "axis": "N"}
    per_token = StepOutput("token_hidden_states", "y", "T")
    assert StepOutput(**per_token.to_json()) == per_token
