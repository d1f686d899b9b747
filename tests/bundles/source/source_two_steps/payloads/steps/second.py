"""Step ``second`` (needs ``first``): two agents in a sequence, reading what ``first`` said."""

from mn_sdk.step_graph import InputSpec, OutputSpec, StepSpec, agent, flow_output, sequence, upstream

STEP = StepSpec(
    input=InputSpec(fields={"from_first": upstream("first", "said")}),
    flow=sequence(agent("three"), agent("four")),
    output=OutputSpec(fields={"said": flow_output()}),
)
