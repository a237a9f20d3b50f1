"""Coordinator: planning, the local launcher and the job driver (control plane)."""
