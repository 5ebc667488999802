"""Checkpoints: save and load, checksums, the model description, resume."""
