"""Random PEFT LoRA adapters made with peft itself, and the HF reference with an adapter merged."""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.lora_layout import TARGET_MODULES


def make_peft_adapter(base: Path, directory: Path, rank: int = 4, alpha: float = 8.0, seed: int = 0,
                      targets: tuple[str, ...] = TARGET_MODULES, scale: float = 0.3, **config) -> Path:
    """A random adapter for the HF model at ``base``, saved by peft in ``directory``. lora_B is
    random too (peft's default init makes it zero, which would test nothing); ``scale`` sets the
    weights' spread so that the adapter changes greedy tokens without swamping the base model."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, **config)
    torch.manual_seed(seed)
    adapted = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, scale / max(p.shape) ** 0.5 * 4)
    adapted.save_pretrained(directory)
    return directory


def load_merged(base: Path, adapter: Path | None, dtype: torch.dtype = torch.float32):
    """The HF model at ``base`` with ``adapter`` merged into its weights (None: the base model)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()
