"""Pydantic models, parsing and validation. No Prefect, no store, no I/O beyond reading a named file."""
