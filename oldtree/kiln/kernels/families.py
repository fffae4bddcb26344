"""Imports every kernel family so that each registers its implementations."""

from . import attention, collective, elementwise, embedding, kv_store, linear, linear_fused, norm, rope  # noqa: F401
from . import linear_quantized, linear_quantized_triton, lora, lora_groups, moe, moe_gemm, moe_routing  # noqa: F401
from . import rope_kv_attention, rope_kv_store, views  # noqa: F401
from . import argmax, bitmask, sample  # noqa: F401  (runtime ops: the sampler's kernels)
from . import rows  # noqa: F401
