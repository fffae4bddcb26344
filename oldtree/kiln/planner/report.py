"""A plan as text (what ``kiln plan`` prints) and as JSON (``--json``)."""

from __future__ import annotations

import json
from dataclasses import asdict

from .plan import GB, Plan, PlanError


def _gb(value: float) -> str:
    return f"{value / GB:.2f} GB"


def plan_text(plan: Plan) -> str:
    kv_per_token = plan.kv_bytes_per_token_per_rank
    fits = plan.requested_kv_tokens <= plan.kv_tokens
    assumed = plan.assumptions
    lines = [
        f"model: {plan.model}",
        f"hardware: {plan.gpus} x {plan.gpu}, {_gb(plan.gpu_memory_bytes)} each",
        f"plan: tp={plan.tp} pp={plan.pp} ep={plan.ep} dp={plan.dp}  ({max(plan.tp, plan.ep) * plan.pp} GPU(s) a replica)",
        f"  because {plan.chosen_because}",
        *(f"  not {reason}" for reason in plan.rejected),
        "memory per rank:",
        f"  weights   {_gb(plan.weight_bytes_per_rank)}  ({plan.storage})",
        f"  reserve   {_gb(plan.reserve_bytes_per_rank)}  (activations, CUDA graphs, context: the "
        f"{1 - plan.usable_bytes_per_rank / plan.gpu_memory_bytes:.0%} outside mem_fraction)",
        f"  KV        {_gb(plan.usable_bytes_per_rank - plan.weight_bytes_per_rank)} left: {kv_per_token:,} B a token "
        f"(layers x 2 x {plan.kv_heads_per_rank} KV head(s) x head_dim x dtype) -> {plan.kv_tokens:,} tokens",
        f"  request   {plan.max_seq_len:,} tokens x {plan.concurrency} sequence(s) = {plan.requested_kv_tokens:,} "
        f"tokens: {'fits' if fits else 'does not fit'} "
        f"({plan.requested_kv_tokens / max(plan.kv_tokens, 1):.0%} of the room)",
        f"decode step at batch {plan.concurrency}, every sequence at full context:",
        f"  memory    {_gb(plan.decode_bytes_per_step)} read a step (weights + KV, stages in turn) at "
        f"{assumed['memory_efficiency']:.0%} of {assumed['memory_bandwidth'] / 1e12:g} TB/s",
        f"  all-reduce {plan.allreduce_bytes_per_step / 1e6:.2f} MB a step ({plan.allreduces_per_layer} x layers x "
        "hidden x batch x dtype), "
        f"{plan.allreduce_s * 1e3:.3f} ms over NVLink (ring, {assumed['nvlink_efficiency']:.0%} of "
        f"{assumed['nvlink_bandwidth'] / 1e9:g} GB/s one way, plus {assumed['collective_latency_s'] * 1e6:g} us "
        "a collective)",
        f"  step      {plan.decode_step_s * 1e3:.3f} ms -> ~{plan.tokens_per_s:,.0f} tokens/s over "
        f"{plan.dp} replica(s)",
    ]
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def plan_json(plan: Plan) -> str:
    return json.dumps({"feasible": True, **asdict(plan)}, indent=2)


def error_json(error: PlanError) -> str:
    return json.dumps({"feasible": False, "error": error.summary, "reasons": error.reasons}, indent=2)
