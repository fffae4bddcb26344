"""Prefill/decode disaggregation: the KV pages of a prefilled prompt handed from one engine to another."""
