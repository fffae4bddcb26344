"""The mixture-of-experts families: Mixtral, Qwen2-MoE (shared expert with a sigmoid gate), Qwen3-MoE.

Attention and the rest of the decoder are Llama's (``llama.build_decoder``); each sparse layer's
feed-forward block is ``router_topk`` over the router GEMM's logits, then ``moe`` over the layer's
experts stacked into two weights, ``{prefix}.experts.gate_up_proj [E, 2I, H]`` (each expert's gate
rows, then its up rows) and ``{prefix}.experts.down_proj [E, H, I]`` (the names HF transformers 5
gives them in memory). Checkpoints keep one tensor per expert; ``Concat`` and ``Stack`` recipes
assemble the stacks when the artifact is written.

Routers kiln runs: softmax over the experts, top-k, renormalized when the config says (always for
Mixtral, ``norm_topk_prob`` for the Qwens). Anything else a config asks of its router (sigmoid
scoring, expert groups, a scaling factor, a correction bias: DeepSeek's) is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from kiln.compiler.recipes import Concat, Recipe, Stack
from kiln.ir import DType, GraphBuilder, TensorType

from .base import BuildOptions, BuiltModel
from .llama import LlamaConfig, build_decoder, gated_mlp, linear

ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

# Router settings of other MoE families, and the value under which each means what kiln's router does.
_ROUTER_DEFAULTS: dict[str, Any] = {
    "scoring_func": "softmax", "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0, "n_shared_experts": 0,
}
SUPPORTED_ROUTER = "softmax over the experts, top-k, optionally renormalized (no expert groups or scaling)"


class UnsupportedMoE(ValueError):
    """A config asks for an MoE variant kiln does not build."""


@dataclass(frozen=True)
class MoEConfig:
    base: LlamaConfig              # attention, norms, embeddings: as the dense family reads them
    num_experts: int
    top_k: int
    renormalize: bool
    expert_intermediate: int
    shared_intermediate: int       # 0: no shared expert
    sparse_layers: frozenset[int]  # the others have a dense MLP of base.intermediate_size
    block_prefix: str              # "mlp" (Qwen) or "block_sparse_moe" (Mixtral)

    @staticmethod
    def from_hf(config: Mapping[str, Any]) -> "MoEConfig":
        base = LlamaConfig.from_hf(config)
        arch = base.architecture
        _check_router(arch, config)
        experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
        top_k = int(config.get("num_experts_per_tok", 0))
        if not 1 <= top_k <= experts:
            raise UnsupportedMoE(f"{arch}: num_experts_per_tok={top_k} must be in 1..{experts} (the experts)")
        if arch != "MixtralForCausalLM" and config.get("use_sliding_window", False):
            raise UnsupportedMoE(f"{arch}: use_sliding_window=true (a window on some layers) is not supported; "
                                 "supported: full attention on every layer")
        if arch == "MixtralForCausalLM":
            return MoEConfig(base, experts, top_k, True, base.intermediate_size, 0,
                             frozenset(range(base.num_layers)), "block_sparse_moe")
        step = int(config.get("decoder_sparse_step") or 1)
        dense_only = set(config.get("mlp_only_layers") or [])
        sparse = frozenset(i for i in range(base.num_layers) if i not in dense_only and (i + 1) % step == 0)
        shared = int(config.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
        return MoEConfig(base, experts, top_k, bool(config.get("norm_topk_prob", False)),
                         int(config["moe_intermediate_size"]), shared, sparse, "mlp")


def _check_router(arch: str, config: Mapping[str, Any]) -> None:
    for key, meaning_ours in _ROUTER_DEFAULTS.items():
        value = config.get(key)
        if value is not None and value != meaning_ours:
            raise UnsupportedMoE(f"{arch}: router setting {key}={value!r} is not supported; kiln's MoE router is "
                                 f"{SUPPORTED_ROUTER} ({key}={meaning_ours!r})")


def build(config: Mapping[str, Any], options: BuildOptions) -> BuiltModel:
    cfg = MoEConfig.from_hf(config)
    base, dt = cfg.base, options.dtype
    recipes: list[Recipe] = []

    def feed_forward(b: GraphBuilder, x: str, layer: int) -> str:
        prefix, name = f"model.layers.{layer}.{cfg.block_prefix}", f"l{layer}"
        if layer not in cfg.sparse_layers:
            return gated_mlp(b, dt, x, prefix, base.hidden_size, base.intermediate_size, base.mlp_bias, name)
        routed = _routed_experts(b, cfg, dt, x, prefix, name, recipes)
        if not cfg.shared_intermediate:
            return routed
        shared = gated_mlp(b, dt, x, f"{prefix}.shared_expert", base.hidden_size, cfg.shared_intermediate, False,
                           f"{name}.shared")
        gate_logit = linear(b, dt, x, f"{prefix}.shared_expert_gate", 1, base.hidden_size, False,
                            f"{name}.shared_gate")
        gate = b.op("sigmoid", gate_logit, name=f"{name}.shared_gate_p")
        return b.op("add", routed, b.op("scale_rows", shared, gate, name=f"{name}.shared_scaled"),
                    name=f"{name}.moe_out")

    # build_decoder calls feed_forward for every layer before it returns, so recipes is complete then.
    return replace(build_decoder(base, options, feed_forward), recipes=tuple(recipes))


def _routed_experts(b: GraphBuilder, cfg: MoEConfig, dt: DType, x: str, prefix: str, name: str,
                    recipes: list[Recipe]) -> str:
    H, I, E = cfg.base.hidden_size, cfg.expert_intermediate, cfg.num_experts
    logits = linear(b, dt, x, f"{prefix}.gate", E, H, False, f"{name}.router")
    weights, ids = b.op("router_topk", logits, top_k=cfg.top_k, renormalize=cfg.renormalize,
                        names=(f"{name}.route_w", f"{name}.route_ids"))
    gate_up, down = f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"
    recipes.extend(_stack_recipes(cfg, prefix, gate_up, down))
    return b.op("moe", x, weights, ids, b.param(gate_up, TensorType((E, 2 * I, H), dt)),
                b.param(down, TensorType((E, H, I), dt)), name=f"{name}.experts")


def _stack_recipes(cfg: MoEConfig, prefix: str, gate_up: str, down: str) -> list[Recipe]:
    """Each expert's gate and up rows joined, then the experts stacked; likewise the down weights."""
    if cfg.block_prefix == "block_sparse_moe":  # Mixtral: w1 gate, w3 up, w2 down
        names = [(f"{prefix}.experts.{e}.w1.weight", f"{prefix}.experts.{e}.w3.weight",
                  f"{prefix}.experts.{e}.w2.weight") for e in range(cfg.num_experts)]
    else:
        names = [(f"{prefix}.experts.{e}.gate_proj.weight", f"{prefix}.experts.{e}.up_proj.weight",
                  f"{prefix}.experts.{e}.down_proj.weight") for e in range(cfg.num_experts)]
    joined = [Concat(f"{prefix}.experts.{e}.gate_up", (g, u)) for e, (g, u, _) in enumerate(names)]
    return joined + [Stack(gate_up, tuple(j.output for j in joined)), Stack(down, tuple(d for _, _, d in names))]
