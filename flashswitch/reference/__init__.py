"""Reference implementations: numpy_<op> (fp64 oracle) and torch_<op> (vectorized) per op."""
