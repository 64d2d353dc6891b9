"""Celery app and thin tasks, capacity leases, dispatch policy and the fleet client."""
