"""Config spaces (space.py), sweeps (tune.py) and the per-device JSON store (store.py)."""
