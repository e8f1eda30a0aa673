"""Cluster environments: who created the processes, and each one's ranks and rendezvous."""
