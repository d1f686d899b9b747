"""The scheduling simulator (docs/simulator.md): replay a trace of jobs in virtual time through the real scheduler
and the store's admission rule, per strategy, and measure what happened (``mn-prefect simulate``)."""

from mn_prefect.simulate.engine import STRATEGIES, Result, simulate
from mn_prefect.simulate.generate import generate
from mn_prefect.simulate.trace import BadLine, Trace, read_trace

__all__ = ["BadLine", "Result", "STRATEGIES", "Trace", "generate", "read_trace", "simulate"]
