"""ReTopK's fused CPU kernel (``ReTopK(backend="cpu")``): retopk_cpu.cpp, its build and its launcher.

``build`` compiles it (``python -m retopk_core.cpu.build``, run by ``make install``); ``launch`` loads it
and runs one decode step per call. Where it is not built or does not load, ReTopK runs its torch code.
"""
