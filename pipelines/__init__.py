"""Warp-specialized machinery shared by every flash4 kernel.

Shipped as ``flash4.pipelines``. Nothing here imports ``kernels`` or ``flash4``.
"""
