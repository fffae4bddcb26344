"""Model sources: HF directories (``hf.py``), GGUF files converted into one (``gguf.py``, ``gguf_tokenizer.py``),
and the names a user can type for either (``aliases.py``)."""
