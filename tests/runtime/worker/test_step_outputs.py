"""An output added to the step schema in one place (``CompileOptions.step_outputs``): the last
hidden states of each logits row, returned by the eager path and the prefill graphs' padded path
beside the logits. Checked against HF: the final norm of kiln's rows equals HF's last hidden state
(tolerance: f32 on both sides, different summation order, ~1e-6 relative)."""

from __future__ import annotations

import pytest
import torch

from kiln.compiler.options import CompileOptions
from tests.support.hf_models import load_hf
from tests.support.runners import PAGE, cpu_runner
from tests.support.stepping import pages_for, step_lists


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("step_outputs")
    runner = cpu_runner(tmp, max_logit_rows=16, step_outputs=("hidden_states",))
    return runner, load_hf(tmp / "src")


def test_an_unknown_output_is_refused():
    with pytest.raises(ValueError, match="step_outputs: attentions is not a step output; supported: hidden_states"):
        CompileOptions(step_outputs=("attentions",)).validate()


@pytest.mark.parametrize("path", ["graphs", "eager"])
def test_hidden_states_come_back_with_the_logits(setup, path):
    runner, hf = setup
    lengths = [5, 3]
    pages = pages_for(lengths, PAGE)
    if path == "graphs":
        pages = [[page + 10 for page in row] for row in pages]  # the other test's pages stay as they were
    lists = step_lists(lengths, [0, 0], [], pages, every_token=(0, 1))
    assert runner.prefill_graphs.fits(lists)
    result = runner.prefill_graphs.run(lists) if path == "graphs" else runner.forward_eager(lists)
    hidden = result.outputs["hidden_states"]
    assert hidden.shape == (sum(lengths), hf.config.hidden_size)
    with torch.no_grad():
        expected = torch.cat([hf.model(torch.tensor([lists.token_ids[start:start + n]])).last_hidden_state[0]
                              for start, n in zip(lists.q_start, lists.q_len)])
        normed = hf.model.norm(hidden)
    torch.testing.assert_close(normed, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hf.lm_head(normed), result.logits, atol=1e-4, rtol=1e-4)
