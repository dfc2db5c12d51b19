"""Retention: which checkpoints a store keeps (the newest, or the best by a score) and the pruning
that follows each commit."""
