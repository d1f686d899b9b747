"""Running MirrorNeuron workflows: the manifest model, the step ledger and the run engine (pure)."""
