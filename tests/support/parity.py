"""The parity check both model-parity tests run: a batch of prompts prefilled together through a
``PagedRun``, then greedy decode steps, each compared with HF's logits for the same tokens."""

from __future__ import annotations

import torch

from .stepping import PagedRun


def assert_prefill_and_decode_match(run: PagedRun, hf, prompts: list[list[int]], decode_steps: int,
                                    tolerance: float) -> None:
    """Argmax identical at every position and max |logit difference| under ``tolerance``."""
    run.add_sequences(len(prompts))
    logits = run.step(prompts, all_logits=True)
    row = 0
    last = []
    for prompt in prompts:
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        got = logits[row:row + len(prompt)]
        row += len(prompt)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        assert (got - expected).abs().max().item() < tolerance
        last.append(got[-1])
    sequences = [list(p) for p in prompts]
    for _ in range(decode_steps):
        for seq, row_logits in zip(sequences, last):
            seq.append(int(row_logits.argmax()))
        last = run.step([[s[-1]] for s in sequences])
        for seq, got in zip(sequences, last):
            with torch.no_grad():
                expected = hf(torch.tensor([seq])).logits[0, -1]
            assert int(got.argmax()) == int(expected.argmax())
            assert (got - expected).abs().max().item() < tolerance
