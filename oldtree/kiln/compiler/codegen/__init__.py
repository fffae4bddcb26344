"""Code generation: the straight-line step program (``program.py``) and the Triton kernels specialised to
fused nodes (``triton_fused.py``), both written into the artifact."""
