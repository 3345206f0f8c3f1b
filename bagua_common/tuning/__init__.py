"""Choosing settings: the advisor's prediction and the in-band autotuner with its searches."""
