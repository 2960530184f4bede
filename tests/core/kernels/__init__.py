"""Kernel tests (TRITON_INTERPRET on the CPU, compiled on a GPU)."""
