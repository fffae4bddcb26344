"""Model files: one per architecture family, each HF config -> IR graph; and their registry."""

from .base import BuildOptions, BuiltModel
from .registry import family_for, supported_architectures

__all__ = ["BuildOptions", "BuiltModel", "family_for", "supported_architectures"]
