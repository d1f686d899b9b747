"""MirrorNeuron bundles on disk and as Prefect flows: loading, the worker-process contract, placement of each step."""
