"""The device side: the worker interface the engine core drives (``worker``), its ranks in this
process or in worker processes (``ranks``, ``rank_process``, ``step_wire``), and one rank's parts:
the executor (program, weights, arena), the model runner that turns a step's lists into device
inputs, the decode and prefill CUDA graphs, and token readback."""
