"""Graph passes, one a file: each a ``Graph -> Graph`` function (recording recipes for the weights it
changes), run in the order ``kiln/compiler/pipeline.py`` lists; the fusions are rules over ``patterns``."""
