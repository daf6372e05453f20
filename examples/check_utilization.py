r"""Is one GPU kept busy? Check before adding GPUs.

A second GPU only helps when the first is busy: if a step leaves the GPU idle
half the time (waiting for input, or too small to fill it), a second GPU will
wait too. This script runs a step (a chain of matrix products) on one GPU over
and over under `tfshard.utilization.check`, which samples ``nvidia-smi``
meanwhile, and prints the verdict: busy enough to scale out, or not, and what
to change.

The step is what a busy GPU looks like: --products dependent products queued
back to back in one `tf.function`, and one read of the result per step. One
4096 x 4096 product per step, read each time, kept an H100 busy only 48 % of
the time (42-52 %, 2026-11-24): the GPU finished each product in well under a
millisecond and then waited for Python to read it and launch the next. Try
``--products=1`` to see that case.

It needs an NVIDIA driver (``nvidia-smi``). Without one it says so and exits
with status 2. Exit status: 0 busy, 1 not busy, 2 no reading possible.

    python examples/check_utilization.py
    python examples/check_utilization.py --gpu=1 --matrix_size=8192 --duration=10
    python examples/check_utilization.py --products=1     # a step too small: not busy
    python examples/check_utilization.py --nvidia_smi=/usr/bin/nvidia-smi --threshold=80

Copy it with ``_common.py`` (in examples/), which it imports.
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
_PRODUCTS = flags.DEFINE_integer(
    "products",
    32,
    "Dependent matrix products queued back to back in each step, read once at its end; "
    "1 reads every product, which leaves a large GPU waiting for Python.",
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


def make_step(device: str, size: int, products: int = 1) -> Callable[[], float]:
    """One step of work on `device`: `products` dependent ``size x size`` matrix products.

    The step computes ``x = tanh(x @ b / sqrt(size))`` `products` times from ``x = a``
    (the tanh and the scale keep the values in range) and returns ``sum(x)``. The products
    run back to back on the device; only the final sum comes back to Python.

    Returns:
      A function running one step and waiting for its result.
    """
    rng = np.random.default_rng(0)
    with tfshard.pin(device):
        a = tf.constant(rng.standard_normal((size, size), dtype=np.float32))
        b = tf.constant(rng.standard_normal((size, size), dtype=np.float32))
    scale = 1.0 / float(np.sqrt(size))

    @tf.function
    def step() -> tf.Tensor:
        with tf.device(device):
            x = a
            for _ in range(products):  # unrolled: one graph, no host work between products
                x = tf.tanh(tf.linalg.matmul(x, b) * scale)
            return tf.reduce_sum(x)

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
    products: int = 32,
) -> list[utilization.Verdict]:
    """Runs the step on GPU `gpu` under `tfshard.utilization.check`; returns the verdict.

    Raises:
      UtilizationError: no ``nvidia-smi``, or it failed (before any step runs).
      ArgumentError: ``nvidia-smi`` lists no GPU ``gpu``.
    """
    device, _ = step_device(gpu)
    return utilization.check(
        make_step(device, size, products),
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
            f"running {_MATRIX_SIZE.value}x{_MATRIX_SIZE.value} matrix products on {device}, "
            f"{_PRODUCTS.value} per step, for {_DURATION.value:g} s under "
            f"tfshard.utilization.check (threshold {_THRESHOLD.value:g} %)"
        )
        verdicts = run_check(
            _GPU.value,
            _MATRIX_SIZE.value,
            _THRESHOLD.value,
            _DURATION.value,
            _INTERVAL.value,
            _NVIDIA_SMI.value,
            _PRODUCTS.value,
        )
    except tfshard.TfshardError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    for verdict in verdicts:
        print(verdict)
    sys.exit(exit_status(verdicts))


if __name__ == "__main__":
    app.run(main)
