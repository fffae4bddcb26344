"""Kernels: one file per family, each with ``ref_`` torch versions, Triton kernels and launchers,
registered by op and backend in ``registry``; ``config`` holds the tunables their launchers read."""

from .config import KernelConfig
from .registry import KernelImpl, get_impl, impl_for_device, register_impl, select_impl

__all__ = ["KernelConfig", "KernelImpl", "get_impl", "impl_for_device", "register_impl", "select_impl"]
