"""The faces a user types: the ``cardcage`` command, its demo, reports and plugin scaffold."""
