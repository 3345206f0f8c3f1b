"""The data pipeline: the cached dataset and its stores, and the samplers of balanced and elastic jobs."""
