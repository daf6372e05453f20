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

``--first_step`` times training instead, as a new user writes it (a Keras MLP of
``--depth`` x ``--width`` units and a float32 head of 10 classes, a loss object,
SGD with momentum, ``--batch`` rows per step on K devices), each way in fresh
processes (nothing traced before), the median of ``--runs``: the first step
(from the model and optimizer made to the first loss on the host) and the median
of steps 5-29:

- ``tfshard``: a parallelized function of a batch returning the loss and its
  gradients with ``reduce="mean"``, the model and optimizer made in
  ``f.replicas()``, each step ``tfshard.replicas.apply_gradients``, eagerly.
- ``mirrored``: the model compiled in `tf.distribute.MirroredStrategy`'s scope
  on the same devices, ``model.train_on_batch``.
- ``one_device``: the model compiled on the first device, ``model.train_on_batch``.

  python benchmarks/replicas.py --first_step --width=256 --depth=2
  python benchmarks/replicas.py --first_step --width=256 --depth=2 --policy=mixed_float16
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
_FIRST_STEP = flags.DEFINE_bool("first_step", False, "Time the first training step instead.")
_RUNS = flags.DEFINE_integer("runs", 3, "--first_step: fresh processes per way.", lower_bound=1)
_POLICY = flags.DEFINE_string("policy", "float32", "--first_step: the Keras dtype policy.")
# Set by the parent for a child process: which way's first step it times.
_WAY = flags.DEFINE_enum("way", None, ["tfshard", "mirrored", "one_device"], "(internal)")

FIRST_STEP_WAYS = ("tfshard", "mirrored", "one_device")

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


def first_step(tfshard, tf, keras, np, way, devices, width, depth, batch, steps=30):
    """One way's training steps in this fresh process: the first's seconds, later ms."""
    import statistics
    import time

    rng = np.random.default_rng(0)
    x = rng.random((batch, width), dtype=np.float32)
    y = rng.integers(0, 10, batch).astype(np.int32)
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def classifier():
        keras.utils.set_random_seed(1)
        layers = [keras.Input((width,))]
        layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        return keras.Sequential([*layers, keras.layers.Dense(10, dtype="float32")])

    def optimizer():
        sgd = keras.optimizers.SGD(0.01, momentum=0.9)
        # As compile wraps it under mixed_float16: scaled losses, unscaled gradients.
        scaled = keras.mixed_precision.global_policy().name == "mixed_float16"
        return keras.optimizers.LossScaleOptimizer(sgd) if scaled and way == "tfshard" else sgd

    if way == "tfshard":

        @tfshard.parallelize(devices=devices, per_sample=False, reduce="mean")
        def loss_and_gradients(x, y):
            with tf.GradientTape() as tape:
                loss = loss_object(y, model(x))
                scaled = sgd.scale_loss(loss)  # the loss itself unless a LossScaleOptimizer
            return loss, tape.gradient(scaled, model.trainable_variables)

        began = time.perf_counter()
        with loss_and_gradients.replicas():
            model = classifier()
            sgd = optimizer()

        def step():
            loss, grads = loss_and_gradients(x, y)
            tfshard.replicas.apply_gradients(sgd, zip(grads, model.trainable_variables))
            return loss
    else:
        scope = (
            tf.distribute.MirroredStrategy(devices).scope()
            if way == "mirrored"
            else tf.device(devices[0])
        )
        began = time.perf_counter()
        with scope:
            model = classifier()
            model.compile(optimizer=optimizer(), loss=loss_object)

        def step():
            return model.train_on_batch(x, y)

    built = time.perf_counter()
    times, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = float(np.asarray(step()))
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)  # every thread of this process
    assert np.isfinite(loss), loss
    return {
        "build_s": built - began,
        "first_s": times[0],
        "first_cpu_s": cpu[0],
        "later_ms": 1e3 * statistics.median(times[5:]),
        "later_cpu_ms": 1e3 * statistics.median(cpu[5:]),
    }


def first_steps(script: str, runs: int, arguments: list[str]) -> dict:
    """Each way's median over `runs` fresh processes, the ways interleaved."""
    import statistics

    import _child

    got: dict[str, list[dict]] = {way: [] for way in FIRST_STEP_WAYS}
    for _ in range(runs):
        for way in FIRST_STEP_WAYS:
            got[way].append(_child.measured(script, way, [f"--way={way}", *arguments]))
    return {
        way: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for way, results in got.items()
    }


def main_first_step() -> None:
    arguments = ["--first_step", f"--devices={_DEVICES.value}", f"--batch={_BATCH.value}",
                 f"--width={_WIDTH.value}", f"--depth={_DEPTH.value}",
                 f"--policy={_POLICY.value}"]  # fmt: skip
    if _WAY.value:
        import tfshard

        tfshard.virtual_devices(_DEVICES.value)
        import keras
        import numpy as np
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.constant(1.0) + 1.0  # TensorFlow's runtime up before anything is timed
        keras.mixed_precision.set_global_policy(_POLICY.value)
        devices = [f"/device:CPU:{i}" for i in range(_DEVICES.value)]
        times = first_step(tfshard, tf, keras, np, _WAY.value, devices, _WIDTH.value,
                           _DEPTH.value, _BATCH.value)  # fmt: skip
        print(json.dumps(times), flush=True)
        return
    got = first_steps(__file__, _RUNS.value, arguments)
    print(
        f"first training step: MLP {_DEPTH.value} x {_WIDTH.value}, {_BATCH.value} rows, "
        f"SGD with momentum, {_POLICY.value}, {_DEVICES.value} logical CPU devices; "
        f"median of {_RUNS.value} fresh processes"
    )
    print("  (cpu: this process's CPU seconds, all threads; steadier than wall time under load)")
    print(f"  {'way':<11} {'first s':>8} {'vs mirrored':>12} {'vs one device':>14} "
          f"{'first cpu s':>12} {'later ms':>9} {'vs mirrored':>12} {'later cpu ms':>13} "
          f"{'vs mirrored':>12}")  # fmt: skip
    mirrored, one = got["mirrored"], got["one_device"]
    for way, row in got.items():
        row["first_vs_mirrored"] = row["first_s"] / mirrored["first_s"]
        row["first_vs_one_device"] = row["first_s"] / one["first_s"]
        row["later_vs_mirrored"] = row["later_ms"] / mirrored["later_ms"]
        row["later_cpu_vs_mirrored"] = row["later_cpu_ms"] / mirrored["later_cpu_ms"]
        print(
            f"  {way:<11} {row['first_s']:>8.2f} {row['first_vs_mirrored']:>11.2f}x "
            f"{row['first_vs_one_device']:>13.2f}x {row['first_cpu_s']:>12.2f} "
            f"{row['later_ms']:>9.2f} {row['later_vs_mirrored']:>11.2f}x "
            f"{row['later_cpu_ms']:>13.2f} {row['later_cpu_vs_mirrored']:>11.2f}x"
        )
    if _JSON.value:
        with open(_JSON.value, "w") as out:
            json.dump({"first_step": got, "arguments": arguments}, out, indent=1)


def main(argv: list[str]) -> None:
    del argv
    if _FIRST_STEP.value:
        main_first_step()
        return
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
