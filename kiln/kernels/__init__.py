"""Kernels: one file per family, each with ``ref_`` torch versions, Triton kernels and launchers,
registered by op and backend in ``registry``."""

from .registry import KernelImpl, get_impl, register_impl, select_impl

__all__ = ["KernelImpl", "get_impl", "register_impl", "select_impl"]
