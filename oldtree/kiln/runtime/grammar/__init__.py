"""Structured outputs: constrain what a request generates to a JSON schema, regex or grammar.

- ``compiler``: ``GrammarCompiler`` turns a constraint into an xgrammar ``CompiledGrammar`` on a
  thread pool, behind a cache that also remembers failures (``GrammarError``);
- ``tokenizer_info``: the model's vocabulary as xgrammar needs it, built from ``tokenizer.json``;
- ``matcher``: ``GrammarState``, one request's position in its grammar (mask, accept, rollback);
- ``kiln.kernels.bitmask`` (re-exported): the packed allowed-token mask; the sampler applies it to
  logits through the kernel registry (``apply_bitmask``: torch, or Triton on GPU).
"""

from kiln.kernels.bitmask import allocate_bitmask, bitmask_width, unpack_bitmask

from .compiler import CONSTRAINT_KINDS, GrammarCompiler, GrammarError
from .matcher import GrammarState
from .tokenizer_info import build_tokenizer_info

__all__ = ["CONSTRAINT_KINDS", "GrammarCompiler", "GrammarError", "GrammarState", "allocate_bitmask",
           "bitmask_width", "build_tokenizer_info", "unpack_bitmask"]
