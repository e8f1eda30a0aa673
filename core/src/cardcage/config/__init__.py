"""The flags, variables and model contract that every layer reads, checked before anything
starts."""
