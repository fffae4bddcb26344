"""One rank's device side: the executor (program, weights, arena), the model runner that turns a
step's lists into device inputs, the decode and prefill CUDA graphs, and token readback."""
