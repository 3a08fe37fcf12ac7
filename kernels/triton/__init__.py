"""Triton kernels for the jagged ops (imported lazily by the dispatchers: triton is optional)."""
