"""Checkpoint files: written atomically, read and checked with ``weights_only=True``."""
