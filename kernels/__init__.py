"""CuTe-DSL device code of flash4, one module per (architecture, pass).

Shipped as ``flash4.kernels``. Modules here may import ``pipelines`` but never ``flash4``.
"""
