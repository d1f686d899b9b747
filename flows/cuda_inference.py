"""A CUDA flow: asks for one NVIDIA GPU with 20 GB and bf16, and reports the device it was given."""

from prefect import flow, get_run_logger

import mn_prefect
from mn_prefect.decorators import requires


@requires(cpu=2, memory_gb=8, devices=[{"kind": "gpu", "driver": "cuda", "min_memory_mb": 20000,
                                        "capabilities": ["bf16"]}])
@flow(name="cuda-inference")
def cuda_inference(batch: int = 8) -> dict:
    allocation = mn_prefect.allocation()
    device = allocation.allocation.devices[0]
    # A real job would now run its model on CUDA_VISIBLE_DEVICES; this example reports what it got.
    get_run_logger().info("node %s, GPU %s (%s, %s MB), CUDA_VISIBLE_DEVICES=%s, batch %d", allocation.node,
                          device.id, device.model, device.memory_total_mb, device.index, batch)
    return {"node": allocation.node, "device": device.id, "index": device.index}
