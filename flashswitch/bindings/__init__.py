"""Glue from torch tensors to the CUDA kernels: the AOT extension (cuda.py) and the CuPy/NVRTC JIT (cupy.py)."""
