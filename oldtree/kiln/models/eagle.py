"""EAGLE draft heads, in their published checkpoint layouts (SafeAILab/EAGLE, SGLang's
``llama_eagle.py`` / ``llama_eagle3.py``): one or more Llama decoder layers that read the target's
hidden states beside the token embeddings.

- ``LlamaForCausalLMEagle`` (EAGLE, EAGLE-2): ``fc`` ``[H, 2H]`` (bias as the checkpoint has it)
  over ``[embedding, target hidden]``, then ``layers.{i}`` (layer 0 without its input norm), no final
  norm; the logits through the target's ``lm_head``. The hidden input is the target's last hidden
  state after its final norm (``token_hidden_states``), or the draft's own output in later steps.
- ``LlamaForCausalLMEagle3`` (EAGLE-3): ``fc`` ``[H, 3H_target]`` over three target layers' inputs
  (``aux_hidden_states``), then ``midlayer``: the embedding and the hidden state each normed
  (``input_layernorm``, ``hidden_norm``), side by side into q/k/v ``[*, 2H]``, the residual being the
  hidden state; ``norm`` and its own ``lm_head`` over a draft vocabulary, mapped back to target ids by
  ``d2t`` (target id = draft id + d2t[draft id]).

The graph's extra inputs beside the step's fields: ``draft_hidden`` ``[T, H]`` (the hidden state a
row continues from) and, for EAGLE-3, ``target_features`` ``[T, 3H_target]``: each row fills one of
the two and zeros the other (``fc`` has no bias there, so ``fc(0) = 0`` and the sum is whichever
was given), so rows catching up on the target and rows continuing a draft share one step. Outputs:
the logits, each row's ``hidden_states`` (pre-norm: what the next draft step reads) and
``draft_tokens`` (each row's argmax in the target's vocabulary).

Embedding (and EAGLE's lm_head) usually come from the target: ``compiler/sources/eagle.py`` adds
them to the draft's tensors under these names.
"""

from __future__ import annotations

from typing import Any, Mapping

from kiln.ir import DType, GraphBuilder, TensorType

from .base import BuildOptions, BuiltModel, step_outputs
from .llama import LlamaConfig, ROPE_TABLE, gated_mlp, kv_cache_inputs, linear, self_attention, step_inputs
from .rope import cos_sin_table

EAGLE = "LlamaForCausalLMEagle"
EAGLE3 = "LlamaForCausalLMEagle3"
ARCHITECTURES = (EAGLE, EAGLE3)
DRAFT_HIDDEN = "draft_hidden"
TARGET_FEATURES = "target_features"


def build(config: Mapping[str, Any], options: BuildOptions) -> BuiltModel:
    cfg = LlamaConfig.from_hf(config)
    eagle3 = cfg.architecture == EAGLE3
    dt, H = options.dtype, cfg.hidden_size
    max_positions = options.max_seq_len or cfg.max_position_embeddings
    b = GraphBuilder(cfg.architecture)
    step = step_inputs(b, options)
    caches = kv_cache_inputs(b, cfg, dt)
    rope_table = b.param(ROPE_TABLE, TensorType((max_positions, cfg.rope.rot_dim), DType.f32))
    hidden_in = b.input(DRAFT_HIDDEN, TensorType(("T", H), dt))

    def weight(name: str, *shape: int) -> str:
        return b.param(name, TensorType(shape, dt))

    embeds = b.op("embedding", step["token_ids"], weight("embed_tokens.weight", cfg.vocab_size, H), name="embed")
    eps = cfg.rms_norm_eps
    if eagle3:
        target_width = 3 * int(config.get("target_hidden_size") or H)
        features = b.input(TARGET_FEATURES, TensorType(("T", target_width), dt))
        fused = linear(b, dt, features, "fc", H, target_width, False, "fc")
        hidden = b.op("add", fused, hidden_in, name="hidden_in")
        p = "midlayer"
        e = b.op("rmsnorm", embeds, weight(f"{p}.input_layernorm.weight", H), eps=eps, name="embed_normed")
        h = b.op("rmsnorm", hidden, weight(f"{p}.hidden_norm.weight", H), eps=eps, name="hidden_normed")
        x = b.op("concat", e, h, name="attn_in")
        hidden = _layer_rest(b, cfg, options, x, 2 * H, hidden, p, "l0", caches[0], step, rope_table)
    else:
        x = b.op("concat", embeds, hidden_in, name="fc_in")
        hidden = linear(b, dt, x, "fc", H, 2 * H, bool(config.get("bias", False)), "fc")
        for i in range(cfg.num_layers):
            p, n = f"layers.{i}", f"l{i}"
            # Layer 0 reads fc's output as it is: EAGLE drops its input norm.
            x = hidden if i == 0 else b.op("rmsnorm", hidden, weight(f"{p}.input_layernorm.weight", H), eps=eps,
                                            name=f"{n}.attn_in")
            hidden = _layer_rest(b, cfg, options, x, H, hidden, p, n, caches[i], step, rope_table)
    rows = b.op("gather_rows", hidden, step["logits_index"], name="hidden_states")
    vocab = int(config.get("draft_vocab_size") or cfg.vocab_size) if eagle3 else cfg.vocab_size
    normed = b.op("rmsnorm", rows, weight("norm.weight", H), eps=eps, name="final_norm") if eagle3 else rows
    logits = b.op("cast", linear(b, dt, normed, "lm_head", vocab, H, False, "lm_logits"), dtype="f32", name="logits")
    mapped = eagle3 and vocab != cfg.vocab_size
    tokens = b.op("argmax", logits, name="draft_argmax" if mapped else "draft_tokens")
    if mapped:
        offsets = b.op("reshape", b.param("d2t", TensorType((vocab,), DType.i64)), shape=[vocab, 1], name="d2t_rows")
        offset = b.op("embedding", tokens, offsets, name="d2t_offset")
        offset = b.op("cast", b.op("reshape", offset, shape=["N"], name="d2t_flat"), dtype="i32", name="d2t_i32")
        tokens = b.op("add", tokens, offset, name="draft_tokens")
    b.output(*step_outputs(options, {"logits": logits, "hidden_states": rows, "draft_tokens": tokens}))
    return BuiltModel(b.build(), {ROPE_TABLE: cos_sin_table(cfg.rope, max_positions)}, max_positions, cfg.num_layers,
                      cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)


def _layer_rest(b: GraphBuilder, cfg: LlamaConfig, options: BuildOptions, x: str, in_features: int, residual: str,
                prefix: str, name: str, cache: tuple[str, str], step: dict[str, str], rope_table: str) -> str:
    """A decoder layer from its (normed) attention input ``x`` on: attention, the residual add, the
    post-attention norm, the gated MLP and its residual add."""
    o = self_attention(b, cfg, options, x, in_features, f"{prefix}.self_attn", name, cache, step, rope_table)
    hidden = b.op("add", residual, o, name=f"{name}.resid_attn")
    x = b.op("rmsnorm", hidden, b.param(f"{prefix}.post_attention_layernorm.weight",
                                        TensorType((cfg.hidden_size,), options.dtype)),
             eps=cfg.rms_norm_eps, name=f"{name}.mlp_in")
    mlp = gated_mlp(b, options.dtype, x, f"{prefix}.mlp", cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias,
                    f"{name}.mlp")
    return b.op("add", hidden, mlp, name=f"{name}.resid_mlp")
