"""GPU/CPU runtime: the only package that imports torch."""
