"""Text in and out: the tokenizer, chat templates (rendered in a sandbox), incremental
detokenization, stop strings and the per-sample stop rules."""
