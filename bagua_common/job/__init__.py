"""The job around training: starting ranks, agreeing on a signature, checkpoints and resharding."""
