"""Scheduled operations flows (reconcile after node loss) and their Prefect-side effects."""
