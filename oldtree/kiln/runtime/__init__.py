"""The runtime: loads an artifact and runs it. It never imports the compiler.

- ``engine_core``: requests, the scheduler, the radix cache and sampling, one ``step()`` at a time;
- ``worker/``: one rank's device side (executor, model runner, CUDA graphs, token readback);
- ``scheduler/``, ``kvcache/``, ``sampling/``, ``grammar/``: what the engine core drives;
- ``text/``: tokenizer, chat templates, detokenizer, stop rules.
"""
