"""The algorithms' shared parts: configurations, option checks and the pipelines both front ends run."""
