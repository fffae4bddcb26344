"""The tokens each expert of each sparse layer was sent, as the program counts them on the device.

The compiler's ``count_expert_load`` pass gives every sparse layer a ``count_experts`` op over a
graph input ``expert_load.{layer}`` (i64 ``[E]``); the manifest lists them (``runtime.expert_load``).
This module owns those counters on the rank's device: zeros at start, handed to every step beside
the KV pool's views (the step adds to them in place, in eager steps and graph replays alike), and
read back only when asked (``read``: one small copy to the host, the metrics' and bench's pace).

A graph captured at a step's first use (prefill graphs, and decode graphs but the largest) runs that
real step eagerly to warm up before the capture's replay runs it again; ``counted_once`` puts the
counters back after the warm-up so that the step counts once.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import torch


class ExpertLoad:
    def __init__(self, entries: Sequence[Mapping[str, Any]], device: torch.device) -> None:
        self.layers = {entry["input"]: int(entry["layer"]) for entry in entries}
        self.counters = {entry["input"]: torch.zeros(int(entry["experts"]), dtype=torch.int64, device=device)
                         for entry in entries}

    def views(self) -> dict[str, torch.Tensor]:
        """The graph inputs by name, for the step's feeds."""
        return dict(self.counters)

    def read(self) -> dict[int, list[int]]:
        """Tokens sent to each expert so far, by decoder layer (each token counted once per expert it chose)."""
        return {self.layers[name]: counts.tolist() for name, counts in self.counters.items()}


@contextmanager
def counted_once(views: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Restores the expert counters among ``views`` when the block ends (warm-up runs of a real step)."""
    kept = {name: view.clone() for name, view in views.items() if name.startswith("expert_load.")}
    try:
        yield
    finally:
        for name, saved in kept.items():
            views[name].copy_(saved)
