"""How this CPU runs a stage: the compiled kernels the stage math in ``dsv41.ops`` calls.

- ``packed``: weights multiplied in their checkpoint formats (``PackedMatrix``), through
- ``fused_product`` (the weight products, LLVM IR written with ``ir_text``), x86 or portable as
  ``dispatch`` chooses;
- ``key_kernels``, ``quant_kernels``, ``mix_kernels``: numba passes over cached keys, the MX
  encoders and the mHC mix;
- ``cores``: one large op's shares over the host's cores.
"""
