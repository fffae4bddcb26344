"""What every Before/Expected IR test of a pass does: IR text dedented, parsed and verified, the pass
applied, the result verified and printed back, so a test compares two texts."""

from __future__ import annotations

import textwrap
from typing import Callable

from kiln.compiler.passes.base import PassContext
from kiln.ir import Graph, parse_graph, print_graph, verify


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def run_pass(pass_fn: Callable[[Graph, PassContext], Graph], before: str, ctx: PassContext | None = None) -> str:
    """``before`` through ``pass_fn`` as printed IR; both graphs verified."""
    graph = parse_graph(dedent(before))
    verify(graph)
    after = pass_fn(graph, ctx or PassContext())
    verify(after)
    return print_graph(after)
