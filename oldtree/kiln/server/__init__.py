"""``kiln serve``: an OpenAI-compatible HTTP server in three processes.

- HTTP process (``launch``, ``http_process``, ``serve_config``, ``http``, ``gate``, the route modules, ``tokenizer_manager``): FastAPI on
  uvicorn; tokenization, chat templates, validation, request bookkeeping, metrics.
- Scheduler process (``scheduler_process``): ``EngineCore`` in a loop.
- Detokenizer process (``detokenizer_process``): sample events -> text deltas and logprob tokens.

They talk over ZMQ ``ipc://`` sockets with msgpack (``ipc``). Start one with ``kiln serve MODEL``.
"""
