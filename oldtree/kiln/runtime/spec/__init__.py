"""Speculative decoding: its options (``config``), the n-gram drafter (``ngram``), the accept rule
(``verify``) and the step that drafts, verifies and applies for a whole batch (``speculator``)."""
