r"""Keras inference on K devices: weight bytes that cross devices per call, and time per call.

Four ways to run one Keras model's inference over a batch split across K logical
CPU devices, each from its own copy of the model with the same weights:

- ``tfshard_plain``: ``tfshard.parallelize(model)``; the weights live on the
  first device, so every other shard reads them from there on every call.
- ``tfshard_replicated``: ``tfshard.parallelize(f.replicate(model))``; one copy
  of the weights per device (`tfshard.replicas`).
- ``mirrored``: `tf.distribute.MirroredStrategy` on the same devices, the model
  built in its scope, ``strategy.run`` on each replica's slice and
  ``strategy.gather`` of the outputs, in one `tf.function`.
- ``hand_written``: one `tf.function` with a ``tf.device`` block per slice, the
  plain model (what tfshard replaces).

Bytes crossing are read from each traced graph: the variables whose handle an op
of replica k takes while they live on another device (TensorFlow places a
variable's read where the variable is, and the value then crosses). Times are
medians of interleaved rounds, against ``one_device`` (the model on device 0).

  python benchmarks/replicas.py                           # an MLP of 4 x 1024 units, K = 2
  python benchmarks/replicas.py --model=mobilenet --devices=4

On logical CPU devices a crossing is a memcpy in one memory, so the time it
costs is far less than over PCIe between GPUs; the bytes are what a GPU pays.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from absl import app, flags

_MODEL = flags.DEFINE_enum("model", "mlp", ["mlp", "mobilenet"], "The Keras model.")
_DEVICES = flags.DEFINE_integer("devices", 2, "Logical CPU devices K.")
_BATCH = flags.DEFINE_integer("batch", 64, "Rows per call.")
_WIDTH = flags.DEFINE_integer("width", 1024, "MLP units per layer.")
_DEPTH = flags.DEFINE_integer("depth", 4, "MLP layers.")
_REPEATS = flags.DEFINE_integer("repeats", 15, "Timed rounds per method.")
_JSON = flags.DEFINE_string("json", None, "Write the numbers here.")

_REPLICA_OP = re.compile(r"^replica_(\d+)/")
_SHARD_OP = re.compile(r"^shard_(\d+)/")


def build(keras, name: str, width: int, depth: int):
    if name == "mobilenet":
        return keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), alpha=0.35)
    layers = [keras.Input((width,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    return keras.Sequential(layers)


def crossing_bytes(concrete, devices, shard_of) -> int:
    """Bytes of variables that ops of shard k read from another device, per call."""
    import tensorflow as tf

    def where(device: str) -> tuple[str, int]:
        spec = tf.DeviceSpec.from_string(device)
        return (spec.device_type or "CPU").upper(), spec.device_index or 0

    handles = {id(v.handle): v for v in concrete.graph.variables}
    captured = {
        internal.name: handles[id(external)]
        for external, internal in concrete.graph.captures
        if id(external) in handles
    }
    seen: set[tuple[int, str]] = set()
    total = 0
    for op in concrete.graph.get_operations():
        k = shard_of(op.name)
        for tensor in op.inputs if k is not None else ():
            variable = captured.get(tensor.name)
            if variable is None or (k, variable.name) in seen:
                continue
            seen.add((k, variable.name))
            if where(variable.device) != where(devices[k]):
                total += variable.shape.num_elements() * variable.dtype.size
    return total


def methods(tfshard, tf, keras, model, devices, batch: int):
    """name -> (callable on x, bytes of variables crossing devices per call)."""
    sizes = tfshard.parallelize(tf.identity, devices=devices).plan(batch)
    weights = model.get_weights()

    def clone():
        copy = keras.models.clone_model(model)
        copy.set_weights(weights)
        return copy

    with tf.device(devices[0]):
        one = clone()
    one_device = tf.function(lambda x: one(x))

    plain = tfshard.parallelize(clone(), devices=devices)
    replicated = tfshard.parallelize(plain.replicate(model), devices=devices)

    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice(devices[0])
    )
    with strategy.scope():
        mirrored_model = clone()
    starts = [sum(sizes[:k]) for k in range(len(devices))]

    @tf.function
    def mirrored(x):
        def replica(x):
            k = tf.distribute.get_replica_context().replica_id_in_sync_group
            start = tf.gather(tf.constant(starts), k)
            size = tf.gather(tf.constant(sizes), k)
            return mirrored_model(x[start : start + size])

        return strategy.gather(strategy.run(replica, args=(x,)), axis=0)

    hand_model = clone()

    @tf.function
    def hand_written(x):
        outputs = []
        for k, (piece, device) in enumerate(zip(tf.split(x, sizes), devices)):
            with tf.name_scope(f"shard_{k}"), tf.device(device):
                outputs.append(hand_model(piece))
        with tf.device(devices[0]):
            return tf.concat(outputs, axis=0)

    return {
        "one_device": one_device,
        "tfshard_plain": plain,
        "tfshard_replicated": replicated,
        "mirrored": mirrored,
        "hand_written": hand_written,
    }


def measure(tfshard, tf, keras, np, model_name, k, batch, width, depth, repeats):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _harness

    devices = [f"/device:CPU:{i}" for i in range(k)]
    keras.utils.set_random_seed(0)
    shape = (batch, 32, 32, 3) if model_name == "mobilenet" else (batch, width)
    # The model and its reference on the first CPU device by name: TensorFlow's default
    # device is GPU:0 on a machine with a GPU, which would move the weights' home there.
    with tf.device(devices[0]):
        model = build(keras, model_name, width, depth)
        x = tf.constant(np.random.default_rng(0).random(shape, dtype=np.float32))
        want = model(x).numpy()
        runs = methods(tfshard, tf, keras, model, devices, batch)
    crossing = {}
    for name, run in runs.items():
        got = run(x).numpy()
        error = float(np.max(np.abs(got - want)))
        assert error <= 1e-4 * max(1.0, float(np.max(np.abs(want)))), (name, error)
        if name.startswith("tfshard"):
            reads = tfshard.replicas.variable_reads(run.get_concrete_function(x), run.devices)
            crossing[name] = sum(tfshard.replicas.remote_bytes(shard) for shard in reads)
        elif name == "mirrored":
            crossing[name] = crossing_bytes(
                run.get_concrete_function(x),
                devices,
                lambda op: int(m.group(1)) if (m := _REPLICA_OP.match(op)) else 0,
            )
        elif name == "hand_written":
            crossing[name] = crossing_bytes(
                run.get_concrete_function(x),
                devices,
                lambda op: int(m.group(1)) if (m := _SHARD_OP.match(op)) else None,
            )
        else:
            crossing[name] = 0
    times = _harness.time_rounds(runs, [x], repeats=repeats, warmup=2)
    weights = sum(w.size * w.dtype.itemsize for w in model.get_weights())
    rows = []
    for name in runs:
        rows.append(
            {
                "method": name,
                "crossing_bytes": crossing[name],
                "ms_per_call": 1e3 * _harness.median(times[name]),
                "vs_plain": _harness.paired_ratio(times[name], times["tfshard_plain"]),
            }
        )
    return {
        "model": model_name,
        "devices": k,
        "batch": batch,
        "weight_bytes": weights,
        "rows": rows,
    }


def main(argv: list[str]) -> None:
    del argv
    import tfshard  # after flags: --help stays fast

    tfshard.virtual_devices(_DEVICES.value)
    import keras
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    result = measure(
        tfshard,
        tf,
        keras,
        np,
        _MODEL.value,
        _DEVICES.value,
        _BATCH.value,
        _WIDTH.value,
        _DEPTH.value,
        _REPEATS.value,
    )
    print(
        f"{result['model']}: {result['weight_bytes'] / 1e6:.1f} MB of weights, "
        f"{result['batch']} rows on {result['devices']} logical CPU devices"
    )
    header = f"{'weight bytes crossing/call':>27} {'ms/call':>8} {'time vs plain':>14}"
    print(f"  {'method':<20} {header}")
    for row in result["rows"]:
        print(
            f"  {row['method']:<20} {row['crossing_bytes']:>27,} {row['ms_per_call']:>8.2f} "
            f"{row['vs_plain']:>13.2f}x"
        )
    if _JSON.value:
        with open(_JSON.value, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    app.run(main)
