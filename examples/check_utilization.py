r"""Is one GPU kept busy? Check before adding GPUs.

A second GPU only helps when the first is busy: if a step leaves the GPU idle
half the time (waiting for input, or too small to fill it), a second GPU will
wait too. This script runs a step (matrix products) on one GPU over and over
under `tfshard.utilization.check`, which samples ``nvidia-smi`` meanwhile, and
prints the verdict: busy enough to scale out, or not, and what to change.

It needs an NVIDIA driver (``nvidia-smi``). Without one it says so and exits
with status 2. Exit status: 0 busy, 1 not busy, 2 no reading possible.

    python examples/check_utilization.py
    python examples/check_utilization.py --gpu=1 --matrix_size=8192 --duration=10
    python examples/check_utilization.py --nvidia_smi=/usr/bin/nvidia-smi --threshold=80
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import numpy as np
from _common import tf
from absl import app, flags

import tfshard
from tfshard import utilization

_GPU = flags.DEFINE_integer(
    "gpu", 0, "The GPU to run on and judge, as TensorFlow numbers it (GPU:N).", lower_bound=0
)
_MATRIX_SIZE = flags.DEFINE_integer(
    "matrix_size",
    4096,
    "Side of the square matrices multiplied in each step; smaller steps leave the GPU idle.",
    lower_bound=1,
)
_THRESHOLD = flags.DEFINE_float(
    "threshold",
    90.0,
    "Mean utilisation, in percent, that counts as busy.",
    lower_bound=0,
    upper_bound=100,
)
_DURATION = flags.DEFINE_float(
    "duration", 5.0, "Seconds to run the step and sample, after one warm-up step.", lower_bound=0
)
_INTERVAL = flags.DEFINE_float("interval", 0.5, "Seconds between nvidia-smi samples.")
_NVIDIA_SMI = flags.DEFINE_string(
    "nvidia_smi", None, "The nvidia-smi to run. Default: $TFSHARD_NVIDIA_SMI, else PATH."
)

flags.register_validator("interval", lambda v: v > 0, "--interval must be > 0 seconds")


def make_step(device: str, size: int) -> Callable[[], float]:
    """One step of work on `device`: a product of two ``size x size`` matrices.

    Returns:
      A function running one step and waiting for its result.
    """
    rng = np.random.default_rng(0)
    with tfshard.pin(device):
        a = tf.constant(rng.standard_normal((size, size), dtype=np.float32))
        b = tf.constant(rng.standard_normal((size, size), dtype=np.float32))

    @tf.function
    def step() -> tf.Tensor:
        with tf.device(device):
            return tf.reduce_sum(tf.linalg.matmul(a, b))

    return lambda: float(step())  # reading the result waits for the GPU


def step_device(gpu: int) -> tuple[str, str]:
    """Where the step runs: GPU ``gpu`` if TensorFlow sees it, else the CPU, and why."""
    if gpu < tfshard.num_gpus():
        return tfshard.gpu(gpu), ""
    return tfshard.cpu(), (
        f"TensorFlow sees no GPU:{gpu} ({tfshard.num_gpus()} GPU(s): a CPU-only TensorFlow "
        "build, or CUDA_VISIBLE_DEVICES hides it), so the step runs on the CPU; the "
        f"verdict is about whatever else runs on GPU:{gpu}"
    )


def run_check(
    gpu: int,
    size: int,
    threshold: float = 90.0,
    duration: float = 5.0,
    interval: float = 0.5,
    nvidia_smi: str | None = None,
) -> list[utilization.Verdict]:
    """Runs the step on GPU `gpu` under `tfshard.utilization.check`; returns the verdict.

    Raises:
      UtilizationError: no ``nvidia-smi``, or it failed (before any step runs).
      ArgumentError: ``nvidia-smi`` lists no GPU ``gpu``.
    """
    device, _ = step_device(gpu)
    return utilization.check(
        make_step(device, size),
        threshold=threshold,
        duration=duration,
        interval=interval,
        devices=[f"GPU:{gpu}"],
        nvidia_smi=nvidia_smi,
    )


def exit_status(verdicts: Sequence[utilization.Verdict]) -> int:
    """0 when every GPU judged is busy, else 1."""
    return 0 if verdicts and all(v.busy for v in verdicts) else 1


def main(argv: list[str]) -> None:
    del argv
    try:
        # Ask the driver first: without one there is nothing to measure.
        utilization.query(_NVIDIA_SMI.value)
        device, note = step_device(_GPU.value)
        if note:
            print(f"note: {note}")
        print(
            f"running {_MATRIX_SIZE.value}x{_MATRIX_SIZE.value} matrix products on {device} "
            f"for {_DURATION.value:g} s under tfshard.utilization.check (threshold "
            f"{_THRESHOLD.value:g} %)"
        )
        verdicts = run_check(
            _GPU.value,
            _MATRIX_SIZE.value,
            _THRESHOLD.value,
            _DURATION.value,
            _INTERVAL.value,
            _NVIDIA_SMI.value,
        )
    except tfshard.TfshardError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    for verdict in verdicts:
        print(verdict)
    sys.exit(exit_status(verdicts))


if __name__ == "__main__":
    app.run(main)
