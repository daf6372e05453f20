r"""K large matrix products on K devices at once, against the same K in sequence on one.

Each device multiplies its own pair of matrices. With K devices the K products
should take about as long as one: near-linear scaling. Logical CPU devices
(``--virtual_devices``) share the machine's cores, so there the speed-up is
bounded by the number of cores as well.

Both runs start from inputs on the first device and end with the products
gathered there, so the transfers to the other devices are part of the time.

    python examples/matmul_scaling.py
    python examples/matmul_scaling.py --virtual_devices=4 --size=1024
    python examples/matmul_scaling.py --devices=gpu:0,gpu:1 --size=8192

Copy it with ``_common.py`` (in examples/), which it imports.
"""

from __future__ import annotations

from typing import NamedTuple

import _common
import numpy as np
from _common import tf
from absl import app, flags

import tfshard

_VIRTUAL_DEVICES = _common.define_virtual_devices_flag()
_DEVICES = _common.define_devices_flag()
_CONTEXTS = _common.define_contexts_flag()
_REPEATS = _common.define_repeats_flag()
_SIZE = flags.DEFINE_integer(
    "size", 2048, "Rows (and columns) of each square matrix.", lower_bound=1
)


def matmul(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """The products of one shard's pairs: [k, n, n] x [k, n, n] -> [k, n, n]."""
    return tf.linalg.matmul(a, b)


def make_inputs(count: int, size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`count` pairs of random ``size x size`` float32 matrices, stacked: [count, n, n]."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((count, size, size), dtype=np.float32)
    b = rng.standard_normal((count, size, size), dtype=np.float32)
    return a, b


class Scaling(NamedTuple):
    """Times of the same products on K devices at once and on one device."""

    devices: tuple[str, ...]
    parallel_s: float
    sequential_s: float
    max_abs_diff: float  # between the two runs' products

    @property
    def speedup(self) -> float:
        return self.sequential_s / self.parallel_s


def measure(devices: list[str], size: int, repeats: int = 5) -> Scaling:
    """Times one product per device at once, and the same products on devices[0].

    Args:
      devices: where to multiply, one pair each.
      size: matrix side.
      repeats: timed runs per measurement (median, after a warm-up).

    Returns:
      Both medians, and how far apart the two runs' products are.
    """
    parallel = tfshard.parallelize(matmul, devices=devices, per_sample=False)
    sequential = tfshard.parallelize(matmul, devices=devices[:1], per_sample=False)
    a, b = make_inputs(len(devices), size)
    # [K, n, n] on the first device; the parallel run copies pair k to device k.
    a = tfshard.to_device(tf.constant(a), devices[0])
    b = tfshard.to_device(tf.constant(b), devices[0])
    parallel_s = _common.median_seconds(lambda: parallel(a, b), repeats)
    sequential_s = _common.median_seconds(lambda: sequential(a, b), repeats)
    diff = float(tf.reduce_max(tf.abs(parallel(a, b) - sequential(a, b))))
    return Scaling(parallel.devices, parallel_s, sequential_s, diff)


def report(result: Scaling, size: int) -> str:
    """The lines the script prints for a measurement."""
    k = len(result.devices)
    gflop = 2 * size**3 * k / 1e9
    lines = [
        f"{k} products of {size}x{size} float32 matrices ({gflop:.1f} GFLOP in all)",
        f"  at once on {', '.join(result.devices)}: {result.parallel_s * 1e3:9.1f} ms",
        f"  in sequence on {result.devices[0]}: {result.sequential_s * 1e3:9.1f} ms",
        f"  speed-up: {result.speedup:.2f}x ({_common.ideal_speedup(result.devices)})",
        f"  largest difference between the two runs' products: {result.max_abs_diff:.3g}",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    with _common.exit_on_error():
        setup = _common.setup_devices(_VIRTUAL_DEVICES.value, _DEVICES.value, _CONTEXTS.value)
        print(setup.note)
        print(f"devices: {', '.join(setup.devices)}")
        result = measure(setup.devices, _SIZE.value, _REPEATS.value)
    print(report(result, _SIZE.value))


if __name__ == "__main__":
    app.run(main)
