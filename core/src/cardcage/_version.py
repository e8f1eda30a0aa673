"""The version of cardcage-core."""

__version__ = "0.1.0"
