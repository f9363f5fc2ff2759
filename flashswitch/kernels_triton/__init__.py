"""Triton kernels, one module per op, each with a `launch(...)` taking torch tensors and a config."""
