"""The compiler: a model source read into a graph, the passes over it (``pipeline.py`` lists them in order),
code generation, and the artifact writer. The runtime never imports it: their contract is the artifact."""
