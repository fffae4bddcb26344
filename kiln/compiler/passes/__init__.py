"""Graph passes, one a file: each a ``Graph -> Graph`` function (with its weight transform where it changes
weights), run in the order ``kiln/compiler/pipeline.py`` lists."""
