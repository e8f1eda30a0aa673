"""Choosing a backend: the rules and the selection engine behind ``cardcage.select``."""
