"""Helpers shared by tests: random-weight HF models and a step driver over the paged pool."""
