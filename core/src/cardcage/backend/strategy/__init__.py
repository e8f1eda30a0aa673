"""A backend's per-process role: the Strategy, precision, data sharding and step wrappers."""
