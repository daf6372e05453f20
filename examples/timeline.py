r"""Print what ran where and when in one call: did the devices run at once?

The function is a stack of dense layers for one sample; `f.timeline(x)` makes
one call, the call ``f(x)`` makes, under TensorFlow's profiler and reads its
record: each shard's device, rows, start, end and busy time, the gather, the
tensors that crossed between devices (with their bytes and time on GPUs), and
the parallelism (1.0: one after another, K: all at once).

    python examples/timeline.py                          # GPUs, else 2 logical CPUs
    python examples/timeline.py --virtual_devices=4 --plot=timeline.png
    python examples/timeline.py --shared_counter        # shards that must take turns

With --shared_counter every shard reads one shared tf.Variable first and adds
its sum to it last: TensorFlow orders the reads and writes of one variable, so
each shard waits for the one before it, and the timeline shows them one after
another. (A shard that only adds at its end overlaps its work with the others',
and only the writes wait.)

Copy it with ``_common.py`` (in examples/), which it imports.
"""

from __future__ import annotations

from collections.abc import Sequence

import _common
import numpy as np
from _common import tf
from absl import app, flags

import tfshard

_VIRTUAL_DEVICES = _common.define_virtual_devices_flag()
_DEVICES = _common.define_devices_flag()
_CONTEXTS = _common.define_contexts_flag()
_ROWS = flags.DEFINE_integer("rows", 4096, "Rows in the call's batch.", lower_bound=0)
_LAYERS = flags.DEFINE_integer(
    "layers", 20, "Dense layers (matmul + tanh) per sample.", lower_bound=1
)
_WIDTH = flags.DEFINE_integer(
    "width", 256, "Features per row, and each layer's width.", lower_bound=1
)
_SHARED_COUNTER = flags.DEFINE_bool(
    "shared_counter",
    False,
    "Every shard also reads, then adds to, one shared tf.Variable, which makes the shards "
    "take turns.",
)
_PLOT = _common.define_plot_flag("Also write the timeline as a PNG here")


def build(
    devices: Sequence[str], layers: int, width: int, shared_counter: bool = False, seed: int = 0
) -> tfshard.ShardedFunction:
    """A stack of `layers` tanh layers of `width` on `devices`, whole shards at a time.

    With `shared_counter`, each shard also reads one `tf.Variable` first and
    adds the sum of its outputs to it last (read it as ``f.counter``).
    """
    rng = np.random.default_rng(seed)
    weights = [
        tf.constant((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32))
        for _ in range(layers)
    ]
    counter = tf.Variable(0.0) if shared_counter else None

    def layers_fn(x: tf.Tensor) -> tf.Tensor:  # [B, width] -> [B, width]
        if counter is not None:
            x = x + 0.0 * counter.read_value()  # waits for the shard before it to add
        for w in weights:
            x = tf.tanh(x @ w)
        if counter is not None:
            counter.assign_add(tf.reduce_sum(x))
        return x

    f = tfshard.parallelize(layers_fn, devices=devices, per_sample=False)
    f.counter = counter
    return f


def make_rows(n: int, width: int, seed: int = 1) -> np.ndarray:
    """``n`` random rows, [n, width] float32."""
    return np.random.default_rng(seed).standard_normal((n, width), dtype=np.float32)


def record(f: tfshard.ShardedFunction, x: np.ndarray) -> tfshard.Timeline:
    """One call of `f` on `x`, recorded (one warm-up call first: the record is of a warm call,
    with nothing traced or run for the first time in it)."""
    f(x)
    return f.timeline(x)


def main(argv: list[str]) -> None:
    del argv
    _common.check_plot(_PLOT.value)  # before the call it would plot
    with _common.exit_on_error():
        setup = _common.setup_devices(_VIRTUAL_DEVICES.value, _DEVICES.value, _CONTEXTS.value)
        print(setup.note)
        f = build(setup.devices, _LAYERS.value, _WIDTH.value, _SHARED_COUNTER.value)
        timeline = record(f, make_rows(_ROWS.value, _WIDTH.value))
        print(timeline)
        k = len(timeline.shards)
        if k > 1 and timeline.parallelism < 1.25:
            print(
                f"the shards ran about one after another ({timeline.parallelism:.2f} of {k})"
                + (": each waited for the shared counter" if _SHARED_COUNTER.value else "")
            )
        if _PLOT.value:
            timeline.plot(_PLOT.value)
            print(f"wrote {_PLOT.value}")


if __name__ == "__main__":
    _common.quiet_without_gpu()
    app.run(main)
