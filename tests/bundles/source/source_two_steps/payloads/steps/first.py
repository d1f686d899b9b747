"""Step ``first``: two agents in a sequence; its output is what the second agent said."""

from mn_sdk.step_graph import InputSpec, OutputSpec, StepSpec, agent, flow_output, parallel, run_input, sequence  # noqa: F401

STEP = StepSpec(
    input=InputSpec(fields={"topic": run_input("topic")}),
    flow=sequence(agent("one"), agent("two")),
    output=OutputSpec(fields={"said": flow_output()}),
)
