"""PyTorch reference implementations of the jagged kernels (the CPU backend and the test oracle)."""

from kernels.pytorch.jagged_attention import jagged_attention, jagged_cross_attention

__all__ = ["jagged_attention", "jagged_cross_attention"]
