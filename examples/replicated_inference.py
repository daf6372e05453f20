r"""Keras inference on every device, with one copy of the model's weights per device.

A Keras model's weights live on one device. Parallelized as it is, every shard on
another device reads them from there on every call. ``f.replicate(model)`` puts a
copy on each device (``with f.replicas(): model = build()`` does the same for a
model you build), and each shard reads its own. The script prints tfshard's
explain table for both, with the bytes of weights that cross devices per call,
checks that both give the one-device model's outputs, and times them.

    python examples/replicated_inference.py
    python examples/replicated_inference.py --virtual_devices=4 --model=mobilenet
    python examples/replicated_inference.py --devices=gpu:0,gpu:1 --batch=256

Copy it with ``_common.py`` (in examples/), which it imports.
"""

from __future__ import annotations

import _common
import numpy as np
from _common import tf
from absl import app, flags

import tfshard

_VIRTUAL_DEVICES = _common.define_virtual_devices_flag()
_DEVICES = _common.define_devices_flag()
_CONTEXTS = _common.define_contexts_flag()
_REPEATS = _common.define_repeats_flag()
_MODEL = flags.DEFINE_enum(
    "model",
    "mlp",
    ["mlp", "mobilenet"],
    "mlp: 4 Dense layers of --width units; mobilenet: MobileNetV2 (random weights, "
    "alpha 0.35) on 32 x 32 images.",
)
_BATCH = flags.DEFINE_integer(
    "batch", 64, "Rows per call, split across the devices.", lower_bound=0
)
_WIDTH = flags.DEFINE_integer("width", 512, "Units per Dense layer of the mlp.", lower_bound=1)


def build_model(name: str, width: int):
    """A Keras model with random weights, and its input shape without the batch."""
    import keras

    keras.utils.set_random_seed(0)
    if name == "mobilenet":
        shape = (32, 32, 3)
        return keras.applications.MobileNetV2(weights=None, input_shape=shape, alpha=0.35), shape
    layers = [keras.Input((width,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(4)]
    return keras.Sequential(layers), (width,)


def main(argv: list[str]) -> None:
    del argv
    with _common.exit_on_error():
        setup = _common.setup_devices(_VIRTUAL_DEVICES.value, _DEVICES.value, _CONTEXTS.value)
        print(setup.note)
        # The weights' home is the run's first device, not TensorFlow's default (GPU:0 on a
        # machine with a GPU, even when --virtual_devices runs the shards on the CPU).
        with tfshard.pin(setup.devices[0]):
            model, shape = build_model(_MODEL.value, _WIDTH.value)
            x = tf.constant(
                np.random.default_rng(1).random((_BATCH.value, *shape), dtype=np.float32)
            )
            want = model(x).numpy()

        predict = tfshard.parallelize(model, devices=setup.devices)
        print("\nThe model as it is: its weights live on one device")
        print(predict.explain(x))

        replicated = tfshard.parallelize(predict.replicate(model), devices=setup.devices)
        print("\nWith a copy of the weights on each device: predict.replicate(model)")
        print(replicated.explain(x))

        for name, f in (("as it is", predict), ("replicated", replicated)):
            error = float(np.max(np.abs(f(x).numpy() - want), initial=0.0))
            if error > 1e-4:
                raise SystemExit(f"error: {name}: outputs differ from the model's by {error:.3g}")
        times = {
            name: _common.median_seconds(lambda f=f: f(x), _REPEATS.value)
            for name, f in (("as it is", predict), ("replicated", replicated))
        }
    print(f"\noutputs equal model(x) on one device; ms per call (median of {_REPEATS.value}):")
    for name, seconds in times.items():
        print(f"  {name:<11} {1e3 * seconds:8.2f}")


if __name__ == "__main__":
    app.run(main)
