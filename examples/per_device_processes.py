r"""One worker process per device: a learning-rate sweep, one trial per GPU.

Some work does not fit in one graph: independent models, each with its own
Python training loop. `tfshard.processes.run_per_device` runs it in one process
per device. Each worker is started with ``spawn`` (never ``fork`` once
TensorFlow is imported) and with ``CUDA_VISIBLE_DEVICES`` set to its own GPU
before it imports TensorFlow, so inside the worker that GPU is ``GPU:0``. The
workers get shared arguments (data size, steps) and one argument each (their
trial), and send their results back to this process. If one fails, the others
are stopped and its device and traceback are reported.

Without GPUs the workers run on the CPU, each in its own process with its
share of the cores.

    python examples/per_device_processes.py                 # one worker per GPU, else 2 on CPU
    python examples/per_device_processes.py --virtual_devices=4 --steps=100
    python examples/per_device_processes.py --devices=gpu:0,gpu:1,cpu \
        --learning_rates=0.1,0.3,1.0

Copy it with ``_common.py`` (in examples/), which it imports.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

import _common
import numpy as np
from _common import tf
from absl import app, flags

import tfshard

_VIRTUAL_DEVICES = _common.define_virtual_devices_flag(
    "Run N workers on the CPU, each its own process, instead of one per GPU. "
    f"Default: one worker per GPU, else {_common.DEFAULT_VIRTUAL_DEVICES} on the CPU."
)
_DEVICES = _common.define_devices_flag(
    "Comma-separated devices, one worker each: 'gpu:0,gpu:1', 'cuda1', 'cpu' (repeat it "
    "for several CPU workers), or names from --contexts. Default: one worker per GPU, "
    f"else {_common.DEFAULT_VIRTUAL_DEVICES} on the CPU."
)
_CONTEXTS = _common.define_contexts_flag()
_LEARNING_RATES = flags.DEFINE_list(
    "learning_rates",
    None,
    "One learning rate per worker, e.g. 0.1,0.3. Default: 0.05 times powers of 3.",
)
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps of each trial.", lower_bound=1)
_TIMEOUT = flags.DEFINE_float(
    "timeout",
    600.0,
    "Seconds the whole sweep may take before every worker is stopped; inf for no limit.",
)


def _check_learning_rates(values: list[str] | None) -> bool:
    for value in values or ():
        try:
            rate = float(value)
        except ValueError:
            raise flags.ValidationError(f"{value!r} is not a number") from None
        if not rate > 0:
            raise flags.ValidationError(f"{value!r}: a learning rate is > 0")
    return True


flags.register_validator("learning_rates", _check_learning_rates)
flags.register_validator(
    "timeout",
    lambda seconds: seconds > 0,  # nan is not
    "give a number of seconds > 0, or --timeout=inf for no limit",
)


def train_trial(
    learning_rate: float,
    *,
    steps: int,
    num_examples: int,
    features: int,
    hidden: int = 64,
    threads: int | None = None,
) -> dict[str, Any]:
    """One trial: a small MLP trained with a Python loop, on this process's device.

    Runs inside a worker, where the worker's GPU (if any) is ``GPU:0``. Data
    and initial weights are the same in every trial; only the learning rate
    differs.

    Args:
      learning_rate: the trial's step size.
      steps: training steps (full-batch gradient descent).
      num_examples: size of the synthetic data set.
      features: features per example.
      hidden: width of the hidden layer.
      threads: intra-op threads for this process, set before the first op;
        None leaves TensorFlow's default.

    Returns:
      The trial's final loss, the device it ran on and what it saw.
    """
    if threads is not None:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
    device = tfshard.try_gpu()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((num_examples, features), dtype=np.float32)
    y = np.sin(x @ rng.standard_normal(features).astype(np.float32))[:, None]
    init = {
        "w1": rng.standard_normal((features, hidden)) / np.sqrt(features),
        "w2": rng.standard_normal((hidden, 1)) / np.sqrt(hidden),
    }
    start = time.perf_counter()
    with tf.device(device):
        params = {k: tf.Variable(v.astype(np.float32), name=k) for k, v in init.items()}
        x, y = tf.constant(x), tf.constant(y)

        def loss_fn() -> tf.Tensor:
            prediction = tf.tanh(x @ params["w1"]) @ params["w2"]  # [n, F] -> [n, 1]
            return tf.reduce_mean(tf.square(prediction - y))

        @tf.function
        def step() -> None:
            with tf.GradientTape() as tape:
                loss = loss_fn()
            for var, grad in zip(params.values(), tape.gradient(loss, list(params.values()))):
                var.assign_sub(learning_rate * grad)

        for _ in range(steps):  # the Python-side loop
            step()
        final = float(loss_fn())
    return {
        "learning_rate": learning_rate,
        "loss": final,
        "device": device,
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "pid": os.getpid(),
        "seconds": time.perf_counter() - start,
    }


def choose_devices(
    devices: Sequence[str] | None, virtual_devices: int | None
) -> tuple[list[str], str]:
    """One device per worker from the flags, and a note saying what was chosen.

    Raises:
      ArgumentError: both `devices` and `virtual_devices` are given.
    """
    if devices and virtual_devices is not None:
        raise tfshard.ArgumentError(
            "give --devices (one worker each) or --virtual_devices (N workers on the CPU), not both"
        )
    if devices:
        return list(devices), "from --devices"
    if virtual_devices is not None:
        return ["cpu"] * virtual_devices, f"--virtual_devices={virtual_devices}: workers on the CPU"
    gpus = tfshard.num_gpus()
    if gpus:
        return [f"gpu:{i}" for i in range(gpus)], f"one per GPU ({gpus} found)"
    count = _common.DEFAULT_VIRTUAL_DEVICES
    return [
        "cpu"
    ] * count, f"no GPU found: {count} workers on the CPU (--virtual_devices=N for another count)"


def run_sweep(
    devices: Sequence[str],
    learning_rates: Sequence[float],
    steps: int,
    num_examples: int = 512,
    features: int = 16,
    timeout: float | None = None,
) -> list[dict[str, Any]]:
    """Runs one `train_trial` per device at the same time, in one process each.

    CPU workers get an even share of the cores (one intra-op thread each at
    least), so they do not fight over them.

    Returns:
      The trials' results, in `devices` order.
    """
    cpu_workers = sum(1 for d in devices if str(d).strip().lower().startswith(("cpu", "/cpu")))
    threads = max(1, (os.cpu_count() or 1) // cpu_workers) if cpu_workers else None
    return tfshard.processes.run_per_device(
        train_trial,
        [float(r) for r in learning_rates],
        shared={
            "steps": steps,
            "num_examples": num_examples,
            "features": features,
            "threads": threads,
        },
        devices=devices,
        timeout=timeout,
    )


def main(argv: list[str]) -> None:
    del argv
    with _common.exit_on_error():
        if _CONTEXTS.value is not None:
            tfshard.set_contexts(_CONTEXTS.value, log=False)
        devices, note = choose_devices(_DEVICES.value, _VIRTUAL_DEVICES.value)
        if _LEARNING_RATES.value:
            rates = [float(r) for r in _LEARNING_RATES.value]
            if len(rates) != len(devices):
                raise tfshard.ArgumentError(
                    f"--learning_rates has {len(rates)} values for {len(devices)} workers "
                    f"({', '.join(devices)}); give one per worker"
                )
        else:
            rates = [0.05 * 3**i for i in range(len(devices))]
        print(f"workers: {', '.join(devices)} ({note})")
        print(f"each imports TensorFlow in its own process and trains for {_STEPS.value} steps")
        start = time.perf_counter()
        timeout = None if math.isinf(_TIMEOUT.value) else _TIMEOUT.value
        results = run_sweep(devices, rates, _STEPS.value, timeout=timeout)
        elapsed = time.perf_counter() - start
    for i, (device, result) in enumerate(zip(devices, results)):
        print(
            f"worker {i} on {device} (CUDA_VISIBLE_DEVICES={result['visible']!r}, sees "
            f"{result['device']}, pid {result['pid']}): learning rate "
            f"{result['learning_rate']:.3g} -> loss {result['loss']:.4f} "
            f"({result['seconds']:.1f} s of training)"
        )
    best = min(results, key=lambda r: r["loss"])
    print(f"best learning rate: {best['learning_rate']:.3g} (loss {best['loss']:.4f})")
    print(f"wall time, start-up included: {elapsed:.1f} s")


if __name__ == "__main__":
    app.run(main)
