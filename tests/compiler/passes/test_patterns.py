"""The pattern-rewrite engine on small graphs: binding, privacy, context, placement, sibling groups."""

import pytest

from kiln.compiler.passes.base import PassContext
from kiln.compiler.passes.patterns import Match, Replacement, Rule, op, rewrite, rewrite_siblings, var
from kiln.ir import parse_graph, print_graph, verify

from .ir_text import dedent

BEFORE = dedent("""
    graph g {
      input %x: f32[T, 8]
      input %y: f32[T, 8]
      param @w: f32[8]
      %a = add(%x, %x) : f32[T, 8]
      %b = add(%x, %y) : f32[T, 8]
      %s = silu(%a) : f32[T, 8]
      %m = mul(%s, %b) : f32[T, 8]
      %n = rmsnorm(%m, @w) {eps=1e-05} : f32[T, 8]
      return %n
    }
""")


def apply(text: str, *rules: Rule) -> str:
    graph = parse_graph(text)
    after = rewrite(graph, PassContext(), *rules)
    verify(after)
    return print_graph(after)


def to_silu_mul(m: Match):
    return m.make("silu_mul", [m["gate"], m["up"]], [m.root.out])


def test_a_variable_bound_twice_must_bind_one_value():
    doubled = Rule(op("add", var("v"), var("v")), lambda m: m.make("mul", [m["v"], m["v"]], [m.root.out]))
    after = apply(BEFORE, doubled)
    assert "%a = mul(%x, %x)" in after and "%b = add(%x, %y)" in after


def test_an_absorbed_node_read_elsewhere_blocks_the_match():
    rule = Rule(op("mul", op("silu", var("gate")), var("up")), to_silu_mul)
    assert "%m = silu_mul(%a, %b)" in apply(BEFORE, rule)
    read_elsewhere = BEFORE.replace("return %n", "return %n, %s")
    assert apply(read_elsewhere, rule) == read_elsewhere


def test_a_shared_node_is_made_again_where_the_rule_places_it():
    def norm_with_sum(m: Match):
        return m.make("add_rmsnorm", [m["a"], m["b"], m["w"]], [m.root.out, m.nodes["add"].out], m.root.attrs)

    rule = Rule(op("rmsnorm", op("add", var("a"), var("b"), name="add", shared=True), var("w")), norm_with_sum,
                at="add")
    text = BEFORE.replace("%n = rmsnorm(%m, @w)", "%n = rmsnorm(%b, @w)").replace("return %n", "return %n, %m")
    assert "%n, %b = add_rmsnorm(%x, %y, @w) {eps=1e-05} : f32[T, 8], f32[T, 8]\n  %s = silu(%a)" in apply(text, rule)


def test_declined_builds_and_out_of_order_placements_leave_the_graph():
    assert apply(BEFORE, Rule(op("mul", op("silu", var("gate")), var("up")), lambda m: None)) == BEFORE
    # Placed where the silu was, silu_mul would read %b before the add makes it.
    early = Rule(op("mul", op("silu", var("gate"), name="silu"), var("up")), to_silu_mul, at="silu")
    moved = BEFORE.replace("%b = add(%x, %y) : f32[T, 8]\n  %s = silu(%a) : f32[T, 8]",
                           "%s = silu(%a) : f32[T, 8]\n  %b = add(%x, %y) : f32[T, 8]")
    assert apply(moved, early) == moved
    assert "  %m = silu_mul(%a, %b) : f32[T, 8]\n  %n" in apply(BEFORE, early)


def test_optional_inputs_trailing_inputs_and_outputs_of_one_node():
    text = dedent("""
        graph g {
          input %x: f32[T, 8]
          param @w: f32[4, 8]
          param @bias: f32[4]
          %p = linear(%x, @w) : f32[T, 4]
          %q = linear(%x, @w, @bias) : f32[T, 4]
          %h0, %h1 = split(%p) {sizes=[2, 2]} : f32[T, 2], f32[T, 2]
          %r = add(%h0, %h1) : f32[T, 2]
          %t = add(%h1, %h0) : f32[T, 2]
          return %q, %r, %t
        }
    """)
    seen = []
    rewrite(parse_graph(text), PassContext(), Rule(op("linear", var("x"), var("w"), var("b", optional=True)),
                                                   lambda m: seen.append(m["b"])))
    assert seen == [None, "bias"]
    seen.clear()
    rewrite(parse_graph(text), PassContext(), Rule(op("linear", var("x"), ...), lambda m: seen.append(m.root.out)))
    assert seen == ["p", "q"]
    halves = Rule(op("add", op("split", var("whole"), name="split", output=0), op("split", name="split", output=1)),
                  lambda m: m.make("mul", [m["whole"], m["whole"]], [m.root.out]))
    # Only %r reads the halves in order, and the split has another reader (%t): nothing fuses.
    assert apply(text, halves) == text
    assert "%r = mul(%p, %p)" in apply(text.replace("return %q, %r, %t", "return %q, %r")
                                       .replace("  %t = add(%h1, %h0) : f32[T, 2]\n", ""), halves)


def test_a_rule_that_drops_a_value_still_read_is_an_error():
    rule = Rule(op("mul", op("silu", var("gate"), name="silu", shared=True), var("up")), to_silu_mul)
    with pytest.raises(ValueError, match="drops 's'"):
        apply(BEFORE.replace("return %n", "return %n, %s"), rule)


def test_siblings_group_by_key_and_take_the_first_members_place():
    text = dedent("""
        graph g {
          input %x: f32[T, 8]
          input %y: f32[T, 8]
          %a = silu(%x) : f32[T, 8]
          %b = silu(%y) : f32[T, 8]
          %c = silu(%x) : f32[T, 8]
          %d = add(%a, %c) : f32[T, 8]
          return %d, %b
        }
    """)

    def one_silu(members: list[Match]) -> Replacement:
        first = members[0]
        node = first.make("silu", [first["v"]], [first.root.out])
        views = (first.make("reshape", [node.out], [m.root.out], {"shape": ["T", 8]}) for m in members[1:])
        return Replacement((node, *views))

    graph = rewrite_siblings(parse_graph(text), PassContext(), op("silu", var("v")), lambda m: m["v"], one_silu)
    verify(graph)
    assert print_graph(graph).splitlines()[3:7] == [
        "  %a = silu(%x) : f32[T, 8]",
        '  %c = reshape(%a) {shape=["T", 8]} : f32[T, 8]',
        "  %b = silu(%y) : f32[T, 8]",
        "  %d = add(%a, %c) : f32[T, 8]",
    ]
