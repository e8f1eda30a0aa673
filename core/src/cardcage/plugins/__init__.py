"""Plugins: the manager that finds them, the hooks they implement, their settings and commands."""
