"""Exposing a target model's per-token hidden states as step outputs, for EAGLE draft heads.

A draft head reads the target's features of every token it catches up on (prompt tokens too), not
only of the rows whose logits are wanted, so these outputs are per token (axis ``T``). The model
knows nothing of them: this pass finds the residual stream by structure (the value the final
``gather_rows`` picks the logits rows from, and the chain of residual ``add``s behind it back to the
embedding) and adds the outputs ``ctx.step_outputs`` names:

- ``token_hidden_states`` (EAGLE, EAGLE-2): the final norm applied to every token's last hidden state.

      Before:  %rows = gather_rows(%h, %logits_index); %n = rmsnorm(%rows, @norm) {eps=e}; ...
      After:   ... ; %token_hidden_states = rmsnorm(%h, @norm) {eps=e}; return ..., %token_hidden_states

- ``aux_hidden_states`` (EAGLE-3): the residual stream entering layers ``ctx.aux_hidden_layers``
  (SGLang's convention; layer ``L`` means the last layer's output), side by side.

      After:   ... ; %aux_hidden_states = concat(%s_a, %s_b, %s_c); return ..., %aux_hidden_states

Runs first, on the graph as the model wrote it (its primitive adds); the fusions after it keep these
values, and memory planning keeps graph outputs alive to the end of the step.
"""

from __future__ import annotations

from kiln.ir import Graph, Node, make_node

from .base import PassContext

TOKEN_HIDDEN_STATES = "token_hidden_states"
AUX_HIDDEN_STATES = "aux_hidden_states"
EXPOSABLE = (TOKEN_HIDDEN_STATES, AUX_HIDDEN_STATES)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The layers whose input EAGLE-3 reads when its checkpoint names none (SGLang's default)."""
    return (2, num_layers // 2, num_layers - 3)


def expose_hidden_states(graph: Graph, ctx: PassContext) -> Graph:
    wanted = [name for name in ctx.step_outputs if name in EXPOSABLE]
    if not wanted:
        return graph
    producers = graph.producers()
    rows_node = next((n for n in graph.nodes if n.op == "gather_rows" and n.inputs[1] == "logits_index"), None)
    if rows_node is None:
        raise ValueError(f"{', '.join(wanted)}: the graph has no gather_rows of the logits rows to find its hidden "
                         "states by")
    final = rows_node.inputs[0]
    types = graph.value_types()
    added: list[Node] = []
    if TOKEN_HIDDEN_STATES in wanted:
        norm = next((n for n in graph.nodes if n.op == "rmsnorm" and n.inputs[0] == rows_node.out), None)
        if norm is None:
            raise ValueError(f"{TOKEN_HIDDEN_STATES}: no final norm reads the logits rows")
        added.append(make_node("rmsnorm", [final, norm.inputs[1]], [TOKEN_HIDDEN_STATES],
                               [types[final], types[norm.inputs[1]]], dict(norm.attrs)))
    if AUX_HIDDEN_STATES in wanted:
        stream = _residual_stream(final, producers)
        num_layers = (len(stream) - 1) // 2
        layers = ctx.aux_hidden_layers or default_aux_layers(num_layers)
        bad = [i for i in layers if not 0 <= i <= num_layers]
        if len(layers) != 3 or bad:
            raise ValueError(f"{AUX_HIDDEN_STATES}: needs three layers in 0..{num_layers} (the model has {num_layers}), "
                             f"got {list(layers)}")
        values = [stream[2 * i] for i in layers]
        added.append(make_node("concat", values, [AUX_HIDDEN_STATES], [types[v] for v in values]))
    return graph.replace(nodes=graph.nodes + tuple(added), outputs=graph.outputs + tuple(n.out for n in added))


def _residual_stream(final: str, producers: dict[str, Node]) -> list[str]:
    """The residual stream's values from the embedding to ``final``: each layer adds twice (attention,
    then feed-forward) to its first operand, so value ``2 * i`` enters layer ``i``."""
    stream = [final]
    while stream[-1] in producers and producers[stream[-1]].op == "add":
        stream.append(producers[stream[-1]].inputs[0])
    if len(stream) % 2 == 0 or stream[-1] not in producers or producers[stream[-1]].op != "embedding":
        raise ValueError(f"{AUX_HIDDEN_STATES}: the hidden states are not a residual stream of two adds a layer "
                         "from the embedding")
    return stream[::-1]
