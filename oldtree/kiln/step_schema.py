"""The step schema: every per-step input of a compiled model, declared once.

A step is a batch of sequences, each bringing some new tokens; the program reads index vectors
along three axes (the IR's symbols): ``T`` one entry per token in the step, ``B`` one per
sequence, ``N`` one per row of logits wanted, plus the page table (``B`` rows of ``P`` pages).
Each field here says its name, its axis and the value its padding rows hold when a step is padded
up to a CUDA graph's bucket. Everything else is derived from this list:
- the model's graph inputs (``kiln.models``: one ``b.input`` per field, typed by ``graph_type``);
- the manifest (``runtime.step_schema``), so the runtime reads the artifact's own list;
- the runtime's host lists (``StepLists``: one column per field), its device buffers and the
  staging of a step into them (``runtime/worker/step_buffers.py``), and the feeds of the program.

A feature that needs another input (an adapter index per sequence, image embeddings' rows, draft
positions) adds one ``StepField`` with ``StepSchema.with_fields`` and nothing else: the graph
gains the input, the buffers a region, the staging its padding. Outputs are declared the same way
(``StepOutput``, one row per logits row): every step returns the logits, and a step schema that
names ``hidden_states`` also returns the rows' last hidden states (a draft head's input). Shared by the compiler and the
runtime, like ``artifact_format``, so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

TOKEN = "T"
SEQUENCE = "B"
LOGIT_ROW = "N"
AXES = (TOKEN, SEQUENCE, LOGIT_ROW)
# Padding for sequence offsets: the step's token count, so that offsets stay sorted and a padding
# sequence (no tokens) starts where the real tokens end.
PAD_TOKEN_COUNT = "token_count"


@dataclass(frozen=True)
class StepField:
    """One per-step int32 input. ``pad`` is what padding rows hold (an int, or ``PAD_TOKEN_COUNT``);
    ``columns`` names the second dimension of a 2-D field (the page table's ``P``)."""

    name: str
    axis: str
    pad: int | str
    doc: str
    columns: str | None = None

    def __post_init__(self) -> None:
        if self.axis not in AXES:
            raise ValueError(f"step field {self.name!r}: axis must be one of {', '.join(AXES)}, got {self.axis!r}")
        if not isinstance(self.pad, int) and self.pad != PAD_TOKEN_COUNT:
            raise ValueError(f"step field {self.name!r}: pad must be an int or {PAD_TOKEN_COUNT!r}, got {self.pad!r}")

    @property
    def shape(self) -> tuple[str, ...]:
        return (self.axis,) if self.columns is None else (self.axis, self.columns)

    def pad_value(self, token_count: int) -> int:
        return token_count if self.pad == PAD_TOKEN_COUNT else self.pad

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "axis": self.axis, "pad": self.pad, "doc": self.doc, "columns": self.columns}


@dataclass(frozen=True)
class StepOutput:
    """One per-step output, named as the graph's output value: a row for each logits row (axis
    ``N``: the model gives it), or for each token of the step (axis ``T``: a compiler pass exposes
    it, ``passes/expose_hidden_states.py``)."""

    name: str
    doc: str
    axis: str = LOGIT_ROW

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "doc": self.doc, "axis": self.axis}


LOGITS = StepOutput("logits", "f32 logits of each wanted row [N, vocab]")
HIDDEN_STATES = StepOutput("hidden_states", "each wanted row's last hidden state, before the final norm [N, hidden]")
# EAGLE draft heads' inputs, for every token of the step (the draft reads the target's features of
# each token it catches up on, prompt tokens included).
TOKEN_HIDDEN_STATES = StepOutput("token_hidden_states", "each token's last hidden state after the final norm "
                                 "[T, hidden] (EAGLE and EAGLE-2 draft heads' input)", TOKEN)
AUX_HIDDEN_STATES = StepOutput("aux_hidden_states", "each token's hidden states entering three layers, side by "
                               "side [T, 3 * hidden] (EAGLE-3 draft heads' input)", TOKEN)


@dataclass(frozen=True)
class StepSchema:
    fields: tuple[StepField, ...]
    outputs: tuple[StepOutput, ...] = (LOGITS,)

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"step schema declares {', '.join(duplicates)} more than once")
        if not self.outputs or self.outputs[0] != LOGITS:
            raise ValueError("a step schema's first output is the logits")
        for axis in AXES:
            if not any(f.axis == axis and f.columns is None for f in self.fields):
                raise ValueError(f"step schema has no vector along {axis}: the step's {axis} size is read off one")

    def __iter__(self) -> Iterator[StepField]:
        return iter(self.fields)

    def __getitem__(self, name: str) -> StepField:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"no step field {name!r}; the schema has {', '.join(self.names)}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def on(self, axis: str) -> tuple[StepField, ...]:
        """The vectors along ``axis`` (2-D fields excluded)."""
        return tuple(f for f in self.fields if f.axis == axis and f.columns is None)

    def tables(self) -> tuple[StepField, ...]:
        """The 2-D fields (rows along an axis, a column count each)."""
        return tuple(f for f in self.fields if f.columns is not None)

    def size_fields(self) -> dict[str, str]:
        """For each axis, the field whose length is the step's size along it."""
        return {axis: self.on(axis)[0].name for axis in AXES}

    def with_fields(self, *fields: StepField) -> "StepSchema":
        return StepSchema(self.fields + tuple(fields), self.outputs)

    def with_outputs(self, *outputs: StepOutput) -> "StepSchema":
        return StepSchema(self.fields, self.outputs + tuple(o for o in outputs if o not in self.outputs))

    def to_json(self) -> dict[str, Any]:
        return {"fields": [f.to_json() for f in self.fields], "outputs": [o.to_json() for o in self.outputs]}

    @staticmethod
    def from_json(data: dict[str, Any]) -> "StepSchema":
        return StepSchema(tuple(StepField(**entry) for entry in data["fields"]),
                          tuple(StepOutput(**entry) for entry in data["outputs"]))


STEP_SCHEMA = StepSchema((
    StepField("token_ids", TOKEN, 0, "the token each row brings"),
    StepField("positions", TOKEN, 0, "each token's position in its sequence"),
    StepField("slots", TOKEN, -1, "the KV pool slot each token's K/V goes to (-1: store nothing)"),
    StepField("q_start", SEQUENCE, PAD_TOKEN_COUNT, "each sequence's first token row"),
    StepField("q_len", SEQUENCE, 0, "each sequence's new tokens (0: a padding sequence, skipped)"),
    StepField("kv_len", SEQUENCE, 0, "each sequence's context length, the new tokens included"),
    StepField("page_table", SEQUENCE, 0, "each sequence's pages (row b, column j: the j-th page)", columns="P"),
    StepField("logits_index", LOGIT_ROW, 0, "the token rows whose logits the step returns"),
))
# Speculative draft trees (CompileOptions.tree_attention; passes/tree_attention.py): each token's
# bits over its sequence's last 32 context keys, which of them it attends to (kernels/attention.py).
TREE_MASK = StepField("tree_mask", TOKEN, -1, "each token's draft-tree mask over its sequence's last 32 keys "
                      "(-1: plain causal)")
# A draft head's greedy proposal per row, already in the target's vocabulary (EAGLE-3's d2t applied).
DRAFT_TOKENS = StepOutput("draft_tokens", "each wanted row's greedy draft token, in the target's vocabulary [N] i32")
# The outputs a step may return beyond the logits, by name (what ``CompileOptions.step_outputs`` takes).
OPTIONAL_OUTPUTS = {o.name: o for o in (HIDDEN_STATES, TOKEN_HIDDEN_STATES, AUX_HIDDEN_STATES,
                                               DRAFT_TOKENS)}
