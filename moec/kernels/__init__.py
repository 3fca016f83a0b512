"""Triton kernels, one file per kernel with its torch reference beside it (imported lazily)."""
