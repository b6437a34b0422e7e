"""Checkpoint folders in the released layout: config, validation, reading, writing, text."""
