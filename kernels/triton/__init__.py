"""Triton kernels for the engine's hot operations, one module per operation.

Each computes what its twin in ``kernels.reference`` computes (same signature, same result up to
floating-point summation order); ``registry.TRITON_KERNELS`` bundles them for ``kernels.backend``.
"""
