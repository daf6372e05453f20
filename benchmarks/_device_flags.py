"""The flags that choose a benchmark's devices: the machine's GPUs, or the CPU bed.

Light on purpose (absl only): a script's --help answers before TensorFlow loads.
"""

from __future__ import annotations

from absl import flags

DEVICE_TYPE = flags.DEFINE_enum(
    "device_type", "auto", ["auto", "gpu", "cpu"],
    "auto: the machine's GPUs when TensorFlow lists one, else the CPU split into logical "
    "devices; gpu or cpu to insist.",
)  # fmt: skip
SPLIT_GPU = flags.DEFINE_integer(
    "split_gpu", 0,
    "On GPUs: split GPU 0 into this many logical GPUs (on one card they measure tfshard's "
    "overheads, not a speed-up).",
    lower_bound=0,
)  # fmt: skip
GPU_MEMORY_MB = flags.DEFINE_integer(
    "gpu_memory_mb", 8192, "Memory of each logical GPU of --split_gpu.", lower_bound=1
)


def devices(count: int, needed: int | None = None) -> list[str]:
    """`_harness.machine_devices` with these flags' values; before TensorFlow starts."""
    import _harness  # imports TensorFlow

    return _harness.machine_devices(
        count, needed, DEVICE_TYPE.value, SPLIT_GPU.value, GPU_MEMORY_MB.value
    )
