"""The Llama family: Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm), SmolLM2.

``LlamaConfig.from_hf`` reads an HF ``config.json``; ``build`` writes the model as primitive ops
(no fusion, no sharding: passes do that) with parameters named exactly as in HF checkpoints, so
the weight-name map is the identity except for the tied ``lm_head``. The one computed parameter is
the rope table, returned beside the graph. ``build_decoder`` is the decoder with the feed-forward
block left to the caller: the MoE families (``moe.py``) reuse it with their experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from kiln.ir import DType, Graph, GraphBuilder, TensorType

from .base import BuildOptions, BuiltModel, step_outputs
from .rope import RopeConfig, cos_sin_table

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ROPE_TABLE = "rope.cos_sin"
# Qwen configs carry a sliding_window that applies only when use_sliding_window says so.
_WINDOW_SWITCHED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class LlamaConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int

    @staticmethod
    def from_hf(config: Mapping[str, Any]) -> "LlamaConfig":
        arch = (config.get("architectures") or ["LlamaForCausalLM"])[0]
        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported for {arch}; supported: silu")
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        attention_bias = bool(config.get("attention_bias", False))
        # Qwen2 (dense and MoE) has q/k/v biases and no o bias; Qwen2-MoE's config may say so itself.
        is_qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        qwen2_qkv_bias = bool(config.get("qkv_bias", True))
        window = config.get("sliding_window") or 0
        if arch in _WINDOW_SWITCHED and not config.get("use_sliding_window", False):
            window = 0
        return LlamaConfig(
            architecture=arch,
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(config, head_dim),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qwen2_qkv_bias if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=int(window),
        )


# A decoder layer's feed-forward block: (builder, its normed input, layer index) -> its output, the
# summand the residual stream adds. Dense models give a gated MLP; MoE models (moe.py) their experts.
FeedForward = Callable[[GraphBuilder, str, int], str]


def build(config: Mapping[str, Any], options: BuildOptions) -> BuiltModel:
    cfg = LlamaConfig.from_hf(config)

    def dense(b: GraphBuilder, x: str, layer: int) -> str:
        return gated_mlp(b, options.dtype, x, f"model.layers.{layer}.mlp", cfg.hidden_size, cfg.intermediate_size,
                         cfg.mlp_bias, f"l{layer}")

    return build_decoder(cfg, options, dense)


def build_decoder(cfg: LlamaConfig, options: BuildOptions, feed_forward: FeedForward) -> BuiltModel:
    """The Llama-style decoder (attention as ``cfg`` says, ``feed_forward`` in each layer) as a BuiltModel."""
    max_positions = min(options.max_seq_len, cfg.max_position_embeddings) if options.max_seq_len else \
        cfg.max_position_embeddings
    graph = _build_graph(cfg, options, max_positions, feed_forward)
    return BuiltModel(graph, {ROPE_TABLE: cos_sin_table(cfg.rope, max_positions)}, max_positions, cfg.num_layers,
                      cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)


def linear(b: GraphBuilder, dtype: DType, x: str, prefix: str, out_features: int, in_features: int, bias: bool,
           name: str) -> str:
    """``x @ {prefix}.weight.T`` (+ ``{prefix}.bias``), the parameters declared as the checkpoint names them."""
    w = b.param(f"{prefix}.weight", TensorType((out_features, in_features), dtype))
    if bias:
        return b.op("linear", x, w, b.param(f"{prefix}.bias", TensorType((out_features,), dtype)), name=name)
    return b.op("linear", x, w, name=name)


def gated_mlp(b: GraphBuilder, dtype: DType, x: str, prefix: str, hidden: int, intermediate: int, bias: bool,
              name: str) -> str:
    """down(silu(gate(x)) * up(x)) with HF's ``gate_proj``/``up_proj``/``down_proj`` under ``prefix``."""
    gate = linear(b, dtype, x, f"{prefix}.gate_proj", intermediate, hidden, bias, f"{name}.gate")
    up = linear(b, dtype, x, f"{prefix}.up_proj", intermediate, hidden, bias, f"{name}.up")
    act = b.op("mul", b.op("silu", gate, name=f"{name}.gate_act"), up, name=f"{name}.act")
    return linear(b, dtype, act, f"{prefix}.down_proj", hidden, intermediate, bias, f"{name}.down")


def step_inputs(b: GraphBuilder, options: BuildOptions) -> dict[str, str]:
    """The graph inputs of the step schema's fields, by field name."""
    return {f.name: b.input(f.name, TensorType(f.shape, DType.i32)) for f in options.step_schema}


def kv_cache_inputs(b: GraphBuilder, cfg: LlamaConfig, dtype: DType) -> list[tuple[str, str]]:
    """Each layer's (k, v) pool input, ``[NS, kv_heads, head_dim]``."""
    cache_type = TensorType(("NS", cfg.num_kv_heads, cfg.head_dim), dtype)
    return [(b.input(f"k_cache.{i}", cache_type), b.input(f"v_cache.{i}", cache_type)) for i in range(cfg.num_layers)]


def self_attention(b: GraphBuilder, cfg: LlamaConfig, options: BuildOptions, x: str, in_features: int, prefix: str,
                   name: str, cache: tuple[str, str], step: dict[str, str], rope_table: str) -> str:
    """The attention block's output (o_proj's, before the residual add) for the normed input ``x``
    of ``in_features`` columns; the projections under ``prefix`` as HF names them."""
    dt, D = options.dtype, cfg.head_dim
    q_width, kv_width = cfg.num_heads * D, cfg.num_kv_heads * D
    q = linear(b, dt, x, f"{prefix}.q_proj", q_width, in_features, cfg.qkv_bias, f"{name}.q")
    k = linear(b, dt, x, f"{prefix}.k_proj", kv_width, in_features, cfg.qkv_bias, f"{name}.k")
    v = linear(b, dt, x, f"{prefix}.v_proj", kv_width, in_features, cfg.qkv_bias, f"{name}.v")
    q = b.op("reshape", q, shape=["T", cfg.num_heads, D], name=f"{name}.q_heads")
    k = b.op("reshape", k, shape=["T", cfg.num_kv_heads, D], name=f"{name}.k_heads")
    v = b.op("reshape", v, shape=["T", cfg.num_kv_heads, D], name=f"{name}.v_heads")
    if cfg.qk_norm:
        q = b.op("rmsnorm", q, b.param(f"{prefix}.q_norm.weight", TensorType((D,), dt)), eps=cfg.rms_norm_eps,
                 name=f"{name}.q_normed")
        k = b.op("rmsnorm", k, b.param(f"{prefix}.k_norm.weight", TensorType((D,), dt)), eps=cfg.rms_norm_eps,
                 name=f"{name}.k_normed")
    q = b.op("rope", q, step["positions"], rope_table, name=f"{name}.q_rot")
    k = b.op("rope", k, step["positions"], rope_table, name=f"{name}.k_rot")
    k_cache, v_cache = b.op("kv_store", *cache, k, v, step["slots"], names=(f"{name}.k_cache", f"{name}.v_cache"))
    attn = b.op("paged_attention", q, k_cache, v_cache, step["q_start"], step["q_len"], step["kv_len"],
                step["page_table"], scale=D ** -0.5, page_size=options.page_size, sliding_window=cfg.sliding_window,
                name=f"{name}.attn")
    attn = b.op("reshape", attn, shape=["T", q_width], name=f"{name}.attn_flat")
    return linear(b, dt, attn, f"{prefix}.o_proj", cfg.hidden_size, q_width, cfg.o_bias, f"{name}.o")


def _build_graph(cfg: LlamaConfig, options: BuildOptions, max_positions: int, feed_forward: FeedForward) -> Graph:
    dt, H = options.dtype, cfg.hidden_size
    b = GraphBuilder(cfg.architecture)
    step = step_inputs(b, options)
    ids, logits_index = step["token_ids"], step["logits_index"]
    caches = kv_cache_inputs(b, cfg, dt)
    rope_table = b.param(ROPE_TABLE, TensorType((max_positions, cfg.rope.rot_dim), DType.f32))

    def weight(name: str, *shape: int) -> str:
        return b.param(name, TensorType(shape, dt))

    embed = weight("model.embed_tokens.weight", cfg.vocab_size, H)
    hidden = b.op("embedding", ids, embed, name="embed")
    for i in range(cfg.num_layers):
        p, n = f"model.layers.{i}", f"l{i}"
        x = b.op("rmsnorm", hidden, weight(f"{p}.input_layernorm.weight", H), eps=cfg.rms_norm_eps, name=f"{n}.attn_in")
        o = self_attention(b, cfg, options, x, H, f"{p}.self_attn", n, caches[i], step, rope_table)
        hidden = b.op("add", hidden, o, name=f"{n}.resid_attn")
        x = b.op("rmsnorm", hidden, weight(f"{p}.post_attention_layernorm.weight", H), eps=cfg.rms_norm_eps,
                 name=f"{n}.mlp_in")
        hidden = b.op("add", hidden, feed_forward(b, x, i), name=f"{n}.resid_mlp")
    # Rows first, then the norm (it is per row): only the rows that give logits are normalized, and
    # the norm sits right before the head's GEMM, where fuse_norm_linear can fold it in.
    rows = b.op("gather_rows", hidden, logits_index, name="hidden_states")
    normed = b.op("rmsnorm", rows, weight("model.norm.weight", H), eps=cfg.rms_norm_eps, name="final_norm")
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    logits = b.op("linear", normed, weight(head, cfg.vocab_size, H), name="lm_logits")
    b.output(*step_outputs(options, {"logits": b.op("cast", logits, dtype="f32", name="logits"), "hidden_states": rows}))
    return b.build()

