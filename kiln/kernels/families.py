"""Imports every kernel family so that each registers its implementations."""

from . import attention, elementwise, embedding, kv_store, linear, norm, rope, rope_kv_store, views  # noqa: F401
