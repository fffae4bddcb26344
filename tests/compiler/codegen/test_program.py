"""The generated step program: side-stream ops launched inside ``streams.side()`` and waited for by
``streams.join()`` just before the first op that reads what they made."""

from __future__ import annotations

from kiln.compiler.codegen.program import generate_program
from kiln.compiler.passes.base import PassContext
from kiln.compiler.passes.plan_memory import plan_memory
from kiln.compiler.passes.select_kernels import select_kernels
from kiln.ir import parse_graph
from tests.compiler.passes.test_plan_memory import SIDE_STREAM


def _program(text: str) -> list[str]:
    graph = parse_graph(text)
    ctx = PassContext(symbol_bounds={"T": 4})
    select_kernels(graph, ctx)
    plan_memory(graph, ctx)
    return [line.strip() for line in generate_program(graph, ctx.kernel_choice, ctx.memory_plan).splitlines()]


def _index(lines: list[str], prefix: str) -> int:
    return next(i for i, line in enumerate(lines) if line.startswith(prefix))


def test_the_shrink_runs_on_the_side_stream_and_the_expand_joins_it():
    lines = _program(SIDE_STREAM)
    assert "def bind(kernels, streams):" in lines
    side = _index(lines, "with streams.side():")
    assert lines[side - 1].startswith("# lora_shrink") and lines[side - 1].endswith("(side stream)")
    assert lines[side + 2].startswith("k_torch_lora_shrink(")  # after the arena view of h
    gemm, join, expand = (_index(lines, p) for p in ("k_torch_linear(", "streams.join()", "k_torch_lora_expand("))
    assert side < gemm < join < expand  # the GEMM is launched between the fork and the join
    assert lines.count("streams.join()") == 1


def test_a_side_output_nobody_reads_is_joined_before_the_step_returns():
    unread = "\n".join(line for line in SIDE_STREAM.splitlines() if "lora_expand" not in line)
    lines = _program(unread.replace("return %y", "return %y.base, %y.lora_h"))
    assert lines.index("streams.join()") == _index(lines, "return") - 1
