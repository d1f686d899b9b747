"""A flow that does almost nothing: the benchmark measures scheduling and start-up, not work."""

from prefect import flow


@flow(name="short")
def short(i: int = 0) -> int:
    return i
