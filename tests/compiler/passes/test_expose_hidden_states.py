"""Before/Expected IR tests of expose_hidden_states, and the exposed values against HF's hidden states."""

import pytest
import torch

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.compiler.passes.base import PassContext
from kiln.compiler.passes.expose_hidden_states import default_aux_layers, expose_hidden_states
from kiln.runtime.artifact import load_artifact
from kiln.runtime.worker.model_runner import ModelRunner
from tests.support.hf_models import load_hf, make_hf_model
from tests.support.stepping import pages_for, step_lists

from .ir_text import dedent, run_pass


# Two layers: the residual stream is %e, %a0, %m0, %a1, %m1 (two adds a layer).
BEFORE = dedent("""
    graph g {
      input %token_ids: i32[T]
      input %logits_index: i32[N]
      param @embed: f32[16, 4]
      param @norm: f32[4]
      %e = embedding(%token_ids, @embed) : f32[T, 4]
      %a0 = add(%e, %e) : f32[T, 4]
      %m0 = add(%a0, %e) : f32[T, 4]
      %a1 = add(%m0, %e) : f32[T, 4]
      %m1 = add(%a1, %e) : f32[T, 4]
      %rows = gather_rows(%m1, %logits_index) : f32[N, 4]
      %n = rmsnorm(%rows, @norm) {eps=1e-05} : f32[N, 4]
      return %n
    }
""")


def run(ctx: PassContext) -> str:
    return run_pass(expose_hidden_states, BEFORE, ctx)


def test_exposes_normed_final_states_and_layer_inputs():
    ctx = PassContext(step_outputs=("token_hidden_states", "aux_hidden_states"), aux_hidden_layers=(0, 1, 2))
    assert run(ctx) == dedent("""
        graph g {
          input %token_ids: i32[T]
          input %logits_index: i32[N]
          param @embed: f32[16, 4]
          param @norm: f32[4]
          %e = embedding(%token_ids, @embed) : f32[T, 4]
          %a0 = add(%e, %e) : f32[T, 4]
          %m0 = add(%a0, %e) : f32[T, 4]
          %a1 = add(%m0, %e) : f32[T, 4]
          %m1 = add(%a1, %e) : f32[T, 4]
          %rows = gather_rows(%m1, %logits_index) : f32[N, 4]
          %n = rmsnorm(%rows, @norm) {eps=1e-05} : f32[N, 4]
          %token_hidden_states = rmsnorm(%m1, @norm) {eps=1e-05} : f32[T, 4]
          %aux_hidden_states = concat(%e, %m0, %m1) : f32[T, 12]
          return %n, %token_hidden_states, %aux_hidden_states
        }
    """)


def test_nothing_asked_leaves_the_graph():
    assert run(PassContext(step_outputs=("hidden_states",))) == BEFORE


def test_layers_out_of_range_are_refused():
    with pytest.raises(ValueError, match=r"three layers in 0\.\.2 \(the model has 2\), got \[0, 1, 3\]"):
        run(PassContext(step_outputs=("aux_hidden_states",), aux_hidden_layers=(0, 1, 3)))
    with pytest.raises(ValueError, match="three layers in 0..2"):
        run(PassContext(step_outputs=("aux_hidden_states",)))  # SGLang's default needs 3+ layers


def test_default_layers_are_sglangs():
    assert default_aux_layers(32) == (2, 16, 29)


def test_compiled_values_match_hf_hidden_states(tmp_path):
    """A tiny Llama compiled with both outputs: every token's row equals HF's (final: after the norm,
    as HF's last hidden state; aux: the inputs of layers 0, 1 and 1). f32 both sides: 1e-4 covers
    summation order."""
    source = make_hf_model("llama3", tmp_path / "hf")
    artifact = compile_model(source, tmp_path / "a.kiln", CompileOptions(
        dtype="f32", page_size=4, max_batch_tokens=32, max_batch_size=4,
        step_outputs=("token_hidden_states", "aux_hidden_states"), aux_hidden_layers=(0, 1, 1)))
    runner = ModelRunner(load_artifact(artifact), "cpu", num_pages=16)
    lists = step_lists([7, 5], [0, 0], [0, 1], pages_for([7, 5]))
    outputs = runner.forward_eager(lists).outputs
    hf = load_hf(source)
    with torch.no_grad():
        for i, (start, count) in enumerate([(0, 7), (7, 5)]):
            ids = torch.tensor([lists.token_ids[start:start + count]])
            states = hf(ids, output_hidden_states=True).hidden_states
            rows = slice(start, start + count)
            torch.testing.assert_close(outputs["token_hidden_states"][rows], states[-1][0], atol=1e-4, rtol=1e-4)
            aux = torch.cat([states[0][0], states[1][0], states[1][0]], dim=1)
            torch.testing.assert_close(outputs["aux_hidden_states"][rows], aux, atol=1e-4, rtol=1e-4)
