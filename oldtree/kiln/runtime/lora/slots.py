"""The device side of multi-LoRA: each hook's stacked adapter weights, one slot per resident adapter.

For every hook of the artifact's ``LoraLayout`` two buffers, the graph inputs the ``lora`` ops read:
``A [max_loras, slices * R, in]`` and ``B [max_loras, out, R]``. Writing an adapter into a slot
zeroes the slot and copies each module's (A, B) into its slice's rows; rows past the adapter's rank
and slices it does not adapt stay zero, so they add nothing. The buffers never move: CUDA graphs
captured over them read whatever the slots hold at replay.
"""

from __future__ import annotations

import torch

from kiln.lora_layout import LoraLayout

from .adapter import LoraAdapter


class LoraSlots:
    def __init__(self, layout: LoraLayout, dtype: torch.dtype, device: torch.device) -> None:
        self.layout = layout
        self.dtype = dtype
        rank = layout.max_rank
        self.buffers: dict[str, torch.Tensor] = {}
        for hook in layout.hooks:
            self.buffers[hook.a_input] = torch.zeros((layout.max_loras, len(hook.slices) * rank, hook.in_features),
                                                     dtype=dtype, device=device)
            self.buffers[hook.b_input] = torch.zeros((layout.max_loras, hook.out_features, rank), dtype=dtype,
                                                     device=device)

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Puts ``adapter`` (checked against this layout by ``load_adapter``) into ``slot``."""
        rank = self.layout.max_rank
        for hook in self.layout.hooks:
            a, b = self.buffers[hook.a_input][slot], self.buffers[hook.b_input][slot]
            a.zero_()
            b.zero_()
            start = 0
            for index, piece in enumerate(hook.slices):
                weights = adapter.weights.get(piece.module)
                if weights is not None:
                    lora_a, lora_b = weights
                    a[index * rank:index * rank + lora_a.shape[0]].copy_(lora_a, non_blocking=True)
                    b[start:start + piece.out_features, :lora_b.shape[1]].copy_(lora_b, non_blocking=True)
                start += piece.out_features
