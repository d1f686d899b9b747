"""The real-GPU check (``scripts/gpu-check``): placement on this machine's NVIDIA GPUs, proven from inside each run."""
