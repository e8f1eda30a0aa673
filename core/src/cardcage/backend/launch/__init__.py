"""A backend's process-creation role: launchers, their supervisor, rendezvous, restarts and
watchdog."""
