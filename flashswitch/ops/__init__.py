"""One module per op: argument checks, backend choice, torch.library registration."""
