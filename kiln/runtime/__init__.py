"""The runtime: loads an artifact and runs it (executor, CUDA graphs, KV cache, scheduler, sampling,
grammar constraints, the engine core that ties them together). It never imports the compiler."""
